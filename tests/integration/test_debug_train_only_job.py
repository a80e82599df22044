"""slime's --debug-train-only on the devcluster: `slurmrl submit` of the toy job with
--debug-train-only --load-debug-rollout-data asks SLURM for the trainer's node alone (one group, no
rollout group), the supervisor launches no router and no engine step (so nothing is probed, recovered
or published to), and the trainer trains each rollout of the dump, to the job's end."""

from __future__ import annotations

import json
from pathlib import Path

from rollout import debug_data
from rollout.sample import Sample, Status
from rollout.tiny_model import vocabulary
from tests.integration.test_rl_job import events, status, submit
from tests.slurm_helpers import slurm, wait_job_gone, wait_sacct_states

JOB_S = 180  # submission to the end of a trainer that loads the tiny model and trains 2 rollouts of 4 samples
# the dump's rewards, per rollout: each rollout's mean reward in metrics.jsonl is its own dump's
REWARDS = {0: [1.0, 0.0, 0.0, 0.0], 1: [1.0, 1.0, 1.0, 0.0]}


def write_dump(template: str) -> None:
    """Two rollouts of 2 prompts x 2 samples, 3 prompt tokens and 2 response tokens each."""
    ids = list(vocabulary().values())[10:20]
    for rollout_id, rewards in REWARDS.items():
        samples = [Sample(index=k, group_index=k // 2, prompt="p", tokens=ids[:3] + ids[3 + 2 * k:5 + 2 * k],
                          response="r", response_length=2,
                          reward=reward, loss_mask=[1, 1], status=Status.COMPLETED)
                   for k, reward in enumerate(rewards)]
        debug_data.save(template, rollout_id, samples)


def test_a_debug_train_only_job_trains_the_dump_with_no_engine(devcluster, toy, tmp_path: Path) -> None:
    template = str(tmp_path / "dump" / "{rollout_id}.pt")
    write_dump(template)
    job_dir = tmp_path / "job"
    job_id = submit(toy, job_dir, "--num-rollout", "2", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
                    "--save-interval", "100", "--debug-train-only", "--load-debug-rollout-data", template)
    wait_job_gone(job_id, timeout_s=JOB_S)
    assert status(job_dir)["stop_reason"] == "completed"
    wait_sacct_states(job_id, {job_id: "COMPLETED"})  # one allocation: no JOBID+1 rollout component
    steps = {line.split("|")[1] for line in slurm("sacct", "-n", "-P", "-j", job_id, "-o", "JobID,JobName").split()
             if "." in line.split("|")[0]}
    assert steps - {"batch", "extern"} == {"trainer"}, steps
    assert [e["step"] for e in events(job_dir, "step_launched")] == ["trainer"]
    assert set(status(job_dir)["steps"]) == {"trainer"}
    assert sorted(p.name for p in (job_dir / "logs").iterdir()) == ["trainer.log"]
    rows = [json.loads(line) for line in (job_dir / "metrics.jsonl").read_text().splitlines()]
    assert [(r["rollout_id"], r["samples"], r["reward_mean"]) for r in rows] == [
        (k, len(rewards), sum(rewards) / len(rewards)) for k, rewards in REWARDS.items()]
    assert all(r["train_seconds"] > 0 and not r.get("publish_seconds") for r in rows), rows
