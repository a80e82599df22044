"""The toy job colocated (--colocate: slime's default turns --offload-train and --offload-rollout
on) through `slurmrl submit` on the devcluster: one job (no hetjob), the engines' steps beside the
trainer's (--overlap), CPU engines, the real router and trainer; the weights by reference, as slime
updates colocated engines (--update-weight-transport tensor: /update_weights_from_tensor, here from
/dev/shm), so a restarted engine takes the trainer's next publish.

In one run: it completes with rewards rising; around every training phase the engines release
their memory and take it back (their logs, and the supervisor's gpus_to_trainer/gpus_to_engines
events); an engine SIGKILLed (by PID) while the trainer holds the GPUs is relaunched only after
the trainer hands them back, then at the current weight version; no rollout is lost and no engine
ever serves stale weights. The trainer is held (SIGSTOP) in its turn while the engine dies, so
that the kill lands there whatever the machine's load; it goes on once the restart is deferred.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import psutil

from slurm.devcluster.daemons import wait_for
from tests.integration.test_rl_job import (
    assert_never_stale,
    events,
    heartbeat,
    listening_pid,
    rollouts_done,
    status,
    submit,
)
from tests.slurm_helpers import sacct_rows, wait_job_gone, wait_sacct_states

ROLLOUTS = 10
EVENT_POLL_S = 0.02  # looking for the trainer's switch to the GPUs
MEMORY = re.compile(r"cpu_engine memory (released|resumed) tags=(\S+) weight_version=(\S+)")


def test_colocated_job_offloads_around_training_and_survives_an_engine_kill(devcluster, toy, tmp_path: Path) -> None:
    job_dir = tmp_path / "job"
    # Every rollout saves and takes several optimizer steps: the trainer holds the GPUs a while.
    job_id = submit(toy, job_dir, "--colocate", "--num-rollout", str(ROLLOUTS), "--save-interval", "1",
                    "--global-batch-size", "16", "--update-weight-transport", "tensor")
    killed = frozen = None
    try:
        wait_for(lambda: rollouts_done(job_dir) >= 3, 120, "the first rollouts")
        url = status(job_dir)["steps"]["engine-0"]["url"]
        seen = len(events(job_dir, "gpus_to_trainer"))
        deadline = time.monotonic() + 60
        while len(events(job_dir, "gpus_to_trainer")) == seen:  # the next switch to the trainer
            assert time.monotonic() < deadline, "the trainer did not take the GPUs again"
            time.sleep(EVENT_POLL_S)
        # Hold the trainer inside its turn (SIGSTOP rank 0, the only rank) while the engine dies,
        # so that the kill lands there whatever the machine's load.
        frozen = heartbeat(job_dir)["pid"]
        os.kill(frozen, signal.SIGSTOP)
        killed = listening_pid(url)
        os.kill(killed, signal.SIGKILL)
        wait_for(lambda: events(job_dir, "engine_start_deferred", "engine-0"), 60, "the restart deferred")
        os.kill(frozen, signal.SIGCONT)
        wait_job_gone(job_id, timeout_s=180)
    finally:
        subprocess.run(["scancel", job_id], capture_output=True)
        if killed is not None and psutil.pid_exists(killed):
            os.kill(killed, signal.SIGKILL)
        if frozen is not None and psutil.pid_exists(frozen):
            os.kill(frozen, signal.SIGCONT)
    wait_sacct_states(job_id, {job_id: "COMPLETED"})
    assert len(sacct_rows(job_id, "JobID")) == 1, "one job, not a hetjob"
    state = status(job_dir)
    assert state["stop_reason"] == "completed" and state["weight_version"] == ROLLOUTS

    # the kill landed while the trainer held the GPUs: the restart waited for it to hand them back
    kinds = [(e["kind"], e.get("step")) for e in _all(job_dir)]
    failed = kinds.index(("engine_failed", "engine-0"))
    deferred = kinds.index(("engine_start_deferred", "engine-0"))
    relaunched = next(i for i, k in enumerate(kinds) if k == ("step_launched", "engine-0") and i > failed)
    assert failed < deferred < kinds.index(("gpus_to_engines", None), deferred) < relaunched, kinds
    recovered = events(job_dir, "engine_recovered", "engine-0")
    assert len(recovered) == 1 and recovered[0]["in_router"] and recovered[0]["weight_version"] is not None

    # every training phase between a release and a resume: one switch each way per rollout (and
    # the start's hand-over to the engines)
    assert len(events(job_dir, "gpus_to_trainer")) == ROLLOUTS
    assert len(events(job_dir, "gpus_to_engines")) == ROLLOUTS + 1
    logs = {p.name: MEMORY.findall(p.read_text()) for p in (job_dir / "logs").glob("engine-*.log")}
    assert set(logs) == {"engine-0.log", "engine-1.log"}
    whole = logs["engine-1.log"]  # never killed: released and resumed around every rollout's training
    assert [e for e in whole if e[0] == "released"] == [("released", "weights,kv_cache", str(r))
                                                        for r in range(ROLLOUTS)], whole
    assert [e for e in whole if e[1] == "kv_cache"] == [("resumed", "kv_cache", str(r + 1)) for r in range(ROLLOUTS)]
    assert logs["engine-0.log"], "engine-0 never released its memory"

    metrics = [json.loads(line) for line in (job_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["rollout_id"] for m in metrics] == list(range(ROLLOUTS)), "a rollout was lost or repeated"
    rewards = [m["reward_mean"] for m in metrics]
    assert rewards[0] < 0.2 and max(rewards[-3:]) > 0.5, rewards
    assert_never_stale(job_dir)


def _all(job_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (job_dir / "events.jsonl").read_text().splitlines()]
