"""Engines that cannot come back, in one running toy job on the devcluster (the real router, CPU
engines and trainer, no mocks), two faults in turn (issue 29, items 9 and 8):

- The model folder is deleted mid-run and engine-1 is killed: its relaunch fails, the event names
  the error line of its log, and the second failure the same way gives it up (no restarts spent on
  what a restart does not fix; its step is gone). The job goes on with engine-0: weight folders
  published afterwards still carry config.json and the tokenizer (kept in the job dir at
  submission), and a restarted trainer starts without the model folder.
- With the folder back, engine-0 is made to come back at an old weight version (the CPU engine's
  start-time fault: it loads published weights but keeps reporting its initial version) and
  killed: one recovery relaunches it, finds the version wrong after loading the current one, tries
  once more and gives it up with that reason. It was the last engine: the job fails at once,
  saying so in its status and events (no hang with no worker).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from pathlib import Path

from rollout.cpu_engine.faults import AT_START_ENV, STUCK
from slurm.devcluster.daemons import wait_for
from tests.integration.test_rl_job import STATUS_POLL_S, events, rollouts_done, slurmrl, status, submit
from tests.slurm_helpers import listening_pid, wait_job_gone

FIRST_ROLLOUTS_S = 300  # the job's start (as test_rl_job waits)
GIVEN_UP_S = 120  # two failed starts of an engine and the backoff between them
TRAINER_BACK_S = 240  # a restarted trainer's start, resume and next rollout
JOB_END_S = 240  # engine-0's two relaunches, then the job's end
NO_CONFIG = "is not a Hugging Face model folder (no config.json)"
OLD_VERSION = "it reports weight_version None after a load from disk"


def _steps_running(job_id: str) -> list[str]:
    """The names of the job's steps SLURM lists as running."""
    out = subprocess.run(["squeue", "-h", "-s", "-j", job_id, "-o", "%j"], capture_output=True, text=True, timeout=30)
    return out.stdout.split()


def test_a_lost_model_folder_and_an_engine_at_an_old_version(devcluster, toy, tmp_path: Path) -> None:
    toy_model, data = toy
    model, job_dir, faults = tmp_path / "model", tmp_path / "job", tmp_path / "engine_faults.json"
    shutil.copytree(toy_model, model)
    os.environ[AT_START_ENV] = str(faults)  # the engines read it at each start
    try:
        job_id = submit((model, data), job_dir, "--num-rollout", "100000", "--save-interval", "2",
                        "--restart-backoff", "1")
    finally:
        del os.environ[AT_START_ENV]
    try:
        wait_for(lambda: rollouts_done(job_dir) >= 2, FIRST_ROLLOUTS_S, "the first rollouts")
        urls = {name: s["url"] for name, s in status(job_dir)["steps"].items() if s["url"]}

        # Item 9: the model folder goes, then engine-1 dies.
        shutil.rmtree(model)
        os.kill(listening_pid(urls["engine-1"]), signal.SIGKILL)
        wait_for(lambda: events(job_dir, "engine_given_up", "engine-1"), GIVEN_UP_S, "engine-1 given up")
        failures = events(job_dir, "engine_restart_failed", "engine-1")
        assert len(failures) == 2 and all(NO_CONFIG in e["cause"] and NO_CONFIG in e["reason"] for e in failures), \
            failures
        [given_up] = events(job_dir, "engine_given_up", "engine-1")
        assert "failed the same way" in given_up["reason"] and NO_CONFIG in given_up["reason"], given_up
        assert "engine-1" not in _steps_running(job_id), "the given-up engine's step runs on"
        published = status(job_dir)["weight_version"]
        wait_for(lambda: status(job_dir)["weight_version"] > published, GIVEN_UP_S, "a publish without the folder",
                 interval_s=STATUS_POLL_S)
        folder = job_dir / "weights" / str(status(job_dir)["weight_version"])
        assert (folder / "config.json").is_file() and (folder / "tokenizer.json").is_file(), sorted(os.listdir(folder))

        slurmrl("restart", str(job_dir), "trainer")
        wait_for(lambda: events(job_dir, "trainer_restarted"), TRAINER_BACK_S, "the trainer restarted")
        done = rollouts_done(job_dir)
        wait_for(lambda: rollouts_done(job_dir) > done, TRAINER_BACK_S, "a rollout of the restarted trainer")

        # Item 8: the folder back, engine-0 comes back at an old weight version.
        shutil.copytree(toy_model, model)
        faults.write_text(json.dumps({urls["engine-0"].removeprefix("http://"): {"weight_version": STUCK}}))
        os.kill(listening_pid(urls["engine-0"]), signal.SIGKILL)
        wait_job_gone(job_id, timeout_s=JOB_END_S)
    finally:
        subprocess.run(["scancel", job_id], capture_output=True)
    state = status(job_dir)
    assert state["stop_reason"].startswith("failed: no engine left: engine-0 was given up"), state["stop_reason"]
    assert OLD_VERSION in state["stop_reason"] and state["steps"]["engine-0"]["state"] == "failed", state
    [given_up] = events(job_dir, "engine_given_up", "engine-0")
    assert OLD_VERSION in given_up["reason"] and given_up["restarts"] == 2, given_up
    assert [e["cause"] for e in events(job_dir, "engine_restart_failed", "engine-0")] == [OLD_VERSION] * 2
    launches = [e for e in events(job_dir, "step_launched", "engine-0")]
    assert len(launches) == 3 and launches[-1]["time"] < given_up["time"], "one recovery, two tries, no more"
    assert events(job_dir, "job_failed") and not events(job_dir, "engine_recovered", "engine-0")
