"""Faults under asynchronous RL in a real job on the devcluster: slime's train_async.py with its fully
async rollout (`slurmrl submit train_async.py ... --rollout-function-path
slime.rollout.fully_async_rollout.generate_rollout_fully_async`), the supervisor, the real router,
two CPU engines and the real trainer. ONE tiny job takes independent faults in turn, with groups
always in flight (the worker keeps generating while the trainer trains):

- an engine SIGKILLed, and at the same time a weight update that fails on the other engine (its
  test fault): the supervisor restarts both at the current version; their groups are generated
  again on whichever engine serves;
- the trainer SIGKILLed mid-step: the supervisor restarts it in the job from its checkpoint, and it
  replays the rollouts the journal holds before its worker starts;
- `slurmrl stop`: the trainer stops its worker, keeps the tokens of what was generating, saves.

`slurmrl trace DUMP --metrics metrics.jsonl` then shows generation overlapping training (in the
rollout that overlapped most).

Then every rollout id is in metrics.jsonl once, the rollout dumps (what each rollout trained on)
hold each sample id once, and every sample the data source handed out is trained or waits in the
last checkpoint's ledger: nothing lost, nothing trained twice. The staleness bound holds. (Each
fault's logic alone, and a preemption's save-now mid-overlap, in seconds: tests/trainer/
test_async_faults.py, tests/trainer/test_async_resume.py.)
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from pathlib import Path

import requests
import torch

from contract.job_dir import JobDir
from rollout import trace_view
from slurm.devcluster.daemons import wait_for
from supervisor.keys import load_key
from tests.integration.test_rl_job import events, heartbeat, rollouts_done, slurmrl, status
from tests.integration.test_trainer_faults import trainer_rank
from tests.slurm_helpers import listening_pid, wait_job_gone
from trainer.fully_async_source import LEDGER_KEY

FIRST_ROLLOUTS_S = 300  # bound on the job's first rollouts (the steps start under SLURM)
RECOVERY_S = 180  # bound on the supervisor bringing a step back
STALENESS = 2


def test_async_job_survives_engine_trainer_and_update_faults_losing_no_sample(devcluster, toy, tmp_path: Path) -> None:
    model, data = toy
    job_dir = tmp_path / "job"
    done = slurmrl("submit", "train_async.py", "examples/toy_job.yaml", "--json", "--job-dir", str(job_dir),
                   "--hf-checkpoint", str(model), "--prompt-data", str(data), "--num-rollout", "100000",
                   "--rollout-function-path", "slime.rollout.fully_async_rollout.generate_rollout_fully_async",
                   "--rollout-batch-size", "4", "--save-interval", "2", "--max-weight-staleness", str(STALENESS),
                   "--save-debug-rollout-data", str(job_dir / "dumps" / "{rollout_id}.pt"))
    job_id = json.loads(done.stdout.strip().splitlines()[-1])["job_id"]
    try:
        wait_for(lambda: rollouts_done(job_dir) >= 2, FIRST_ROLLOUTS_S, "the first rollouts")
        urls = {name: s["url"] for name, s in status(job_dir)["steps"].items() if s["url"]}
        requests.post(urls["engine-1"] + "/slurmrl_fault", json={"update": "fail"},
                      headers={"Authorization": f"Bearer {load_key(JobDir(job_dir))}"}, timeout=10).raise_for_status()
        os.kill(listening_pid(urls["engine-0"]), signal.SIGKILL)
        wait_for(lambda: events(job_dir, "engine_recovered", "engine-0") and events(job_dir, "engine_recovered",
                 "engine-1"), RECOVERY_S, "both engines recovered")
        before = rollouts_done(job_dir)
        wait_for(lambda: rollouts_done(job_dir) >= before + 1, RECOVERY_S, "a rollout on the recovered engines")
        rank0 = trainer_rank(job_dir, 0)
        wait_for(lambda: heartbeat(job_dir).get("phase") == "train" and (os.kill(rank0, signal.SIGKILL) or True),
                 RECOVERY_S, "a training step", interval_s=0.002)
        wait_for(lambda: events(job_dir, "trainer_restarted"), RECOVERY_S, "the trainer restarted")
        wait_for(lambda: "replayed from the rollout journal" in (job_dir / "logs" / "trainer.log").read_text()
                 and rollouts_done(job_dir) >= before + 3, RECOVERY_S, "the resumed run going on")
        slurmrl("stop", job_id)
        wait_job_gone(job_id, timeout_s=RECOVERY_S)
    finally:
        subprocess.run(["scancel", job_id], capture_output=True)
    lines = [json.loads(line) for line in (job_dir / "metrics.jsonl").read_text().splitlines()]
    rollouts = [m["rollout_id"] for m in lines]
    assert rollouts == list(range(len(rollouts))), "every rollout id once"
    assert all(m["async/staleness_max"] <= STALENESS for m in lines)
    trained = [s["index"] for r in rollouts for s in torch.load(job_dir / "dumps" / f"{r}.pt")["samples"]]
    assert len(trained) == len(set(trained)), "no sample trained twice"
    latest = (Path(status(job_dir)["last_checkpoint"]) / "common.pt")
    ledger = torch.load(latest, weights_only=False)["common"][LEDGER_KEY]  # the trainer state in it
    waiting = {s["index"] for g in [*ledger["buffer"]["pending"], *ledger["ready"]] for s in g}
    handed_out = ledger["buffer"]["source"]["next_sample_index"]
    # Dropped by the staleness rule (counted; the crashed run's count came back with the journal).
    assert not waiting & set(trained) and set(trained) | waiting <= set(range(handed_out))
    assert len(trained) + len(waiting) + ledger["dropped_samples"] == handed_out, "no sample lost"
    # The trace viewer: a rollout's samples generated while the rollouts before it trained. Which one
    # depends on the machine's pace (one generated while the trainer restarted or replayed overlaps
    # nothing), so the viewer's own reckoning picks the rollout that overlapped most.
    training = trace_view.load_training(job_dir / "metrics.jsonl")
    most = max(rollouts, key=lambda r: trace_view.timeline(
        trace_view.load_dump(job_dir / "dumps" / f"{r}.pt"), [], training)["overlap_s"])
    shown = slurmrl("trace", str(job_dir / "dumps" / f"{most}.pt"), "--metrics",
                    str(job_dir / "metrics.jsonl")).stdout
    overlap = re.search(r"generation overlapping training for ([\d.]+) s", shown)
    assert overlap and float(overlap.group(1)) > 0, shown
