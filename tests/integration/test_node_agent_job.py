"""The toy RL job with `--engine-launch node_agent` on the devcluster: each rollout node's engine runs
in that node's agent step (supervisor/node_agent.py); an engine SIGKILLed is seen, relaunched through
its agent (no new SLURM step), brought to the current weights and admitted, and the job completes."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from slurm.devcluster.daemons import wait_for
from tests.integration.test_rl_job import events, rollouts_done, status, submit
from tests.slurm_helpers import listening_pid, wait_job_gone

FIRST_ROLLOUT_S = 300.0  # the job starts, the engines load, the first rollout ends
RECOVERED_S = 120.0  # for the killed engine to be back in the router
JOB_END_S = 300.0  # for the job to finish its rollouts
ROLLOUTS = 30


def test_an_engine_in_a_node_agent_is_restarted_without_a_new_step(devcluster, toy, tmp_path: Path) -> None:
    job_dir = tmp_path / "job"
    # Rollouts enough (~0.7 s each) for the killed engine's restart (~5 s) to end before the job does.
    job_id = submit(toy, job_dir, "--num-rollout", str(ROLLOUTS), "--engine-launch", "node_agent")
    wait_for(lambda: rollouts_done(job_dir) >= 1, FIRST_ROLLOUT_S, "the first rollout")
    before = status(job_dir)
    # The router, the trainer and one agent per rollout node: no step per engine.
    assert before["steps_launched"] == 4, before
    engines = {name: s for name, s in before["steps"].items() if s["kind"] == "engine"}
    assert len({s["slurm_step"] for s in engines.values()}) == 2  # each runs in its node's agent step

    os.kill(listening_pid(engines["engine-0"]["url"]), signal.SIGKILL)
    wait_for(lambda: bool(events(job_dir, "engine_recovered", "engine-0")), RECOVERED_S, "engine-0 recovered")
    [failed] = events(job_dir, "engine_failed", "engine-0")  # its exit, or the trainer's report: one recovery
    assert "exited with code 137" in failed["reason"] or "reported by the trainer" in failed["reason"]
    wait_job_gone(job_id, timeout_s=JOB_END_S)
    after = status(job_dir)
    assert after["stop_reason"] == "completed" and after["weight_version"] == ROLLOUTS
    assert after["steps"]["engine-0"]["restarts"] == 1 and after["steps"]["engine-1"]["restarts"] == 0
    assert after["steps_launched"] == 4  # the restart was a message to the agent, not a step
    assert [e["step"] for e in events(job_dir, "step_launched") if e["step"].startswith("engine")].count("engine-0") == 2
