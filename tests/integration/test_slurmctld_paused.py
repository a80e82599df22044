"""slurmctld stops answering (SIGSTOP by its PID, for PAUSE_S) just as an engine dies: the
supervisor's SLURM calls of the recovery (squeue, scancel, srun) fail, time out or wait meanwhile
(the job's slurm_command_timeout is shorter than the pause, so a scancel times out; where the dead
engine's step ended by itself, the relaunch's srun waits for slurmctld instead). That is SLURM being
away, not the engine crash-looping: the engine is relaunched once SLURM answers again, not given
up ("0 restarts in a row" before), and the job goes on. slurmctld gets SIGCONT in any case."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import yaml

from slurm.devcluster.daemons import wait_for
from tests.integration.test_rl_job import ROOT, events, listening_pid, rollouts_done, slurmrl, status

PAUSE_S = 15.0  # how long slurmctld is stopped
SLURM_COMMAND_TIMEOUT_S = 5.0  # the job's bound on one SLURM call: shorter than the pause


def _submit(toy: tuple[Path, Path], tmp_path: Path, job_dir: Path) -> str:
    spec = yaml.safe_load((ROOT / "examples/toy_job.yaml").read_text())
    spec["fault_tolerance"]["slurm_command_timeout"] = SLURM_COMMAND_TIMEOUT_S
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(spec))
    model, data = toy
    done = slurmrl("submit", str(tmp_path / "job.yaml"), "--json", "--job-dir", str(job_dir), "--hf-checkpoint",
                   str(model), "--prompt-data", str(data), "--num-rollout", "100000")
    return json.loads(done.stdout.strip().splitlines()[-1])["job_id"]


def test_an_engine_dying_while_slurmctld_is_paused_is_relaunched(devcluster, toy, tmp_path: Path) -> None:
    job_dir = tmp_path / "job"
    job_id = _submit(toy, tmp_path, job_dir)
    slurmctld = devcluster.slurmctld().process()
    assert slurmctld is not None, "slurmctld does not run"
    try:
        wait_for(lambda: rollouts_done(job_dir) >= 1, 180, "the first rollout")
        victim = listening_pid(status(job_dir)["steps"]["engine-0"]["url"])
        paused = time.monotonic()
        try:
            os.kill(slurmctld.pid, signal.SIGSTOP)
            os.kill(victim, signal.SIGKILL)
            wait_for(lambda: events(job_dir, "engine_failed", "engine-0"), PAUSE_S, "the engine's death seen")
            time.sleep(max(0.0, PAUSE_S - (time.monotonic() - paused)))  # the outage lasts PAUSE_S
        finally:
            os.kill(slurmctld.pid, signal.SIGCONT)
            resumed = time.time()
        wait_for(lambda: events(job_dir, "engine_recovered", "engine-0") or events(job_dir, "engine_given_up"),
                 120, "engine-0 recovered or given up")
        assert not events(job_dir, "engine_given_up"), events(job_dir, "engine_given_up")
        recovered = events(job_dir, "engine_recovered", "engine-0")[0]
        assert recovered["in_router"], recovered
        done = rollouts_done(job_dir)
        wait_for(lambda: rollouts_done(job_dir) > done, 120, "a rollout after the recovery")
        waits = events(job_dir, "slurm_unanswered")
        relaunches = [e for e in events(job_dir, "step_launched") if e["step"] == "engine-0"][1:]
        assert waits or relaunches[0]["time"] < resumed, \
            "the supervisor neither said that it waited for SLURM nor relaunched the engine into the outage"
        print(f"engine-0 recovered in {recovered['recover_s']} s with slurmctld stopped {PAUSE_S:.0f} s; "
              f"SLURM waits: {[(w['step'], w['call']) for w in waits]}")
    finally:
        subprocess.run(["scancel", job_id], capture_output=True, timeout=60)
