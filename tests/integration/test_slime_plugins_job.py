"""Plug-ins written for slime train a job on the devcluster: the seed doc's custom generate function
(verbatim, through slime's own `post`) and slime's dynamic-sampling filter, by slime's import
paths. The job completes, every rollout is full, and rewards rise."""

from __future__ import annotations

import json
from pathlib import Path

from tests.integration.test_rl_job import status, submit
from tests.slurm_helpers import wait_job_gone

FILTER = "slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std_with_fallback"


def test_slime_plugins_train_the_toy_job(devcluster, toy, tmp_path: Path) -> None:
    job_dir = tmp_path / "job"
    job_id = submit(toy, job_dir, "--num-rollout", "10",
                    "--custom-generate-function-path", "tests.rollout.slime_plugins.generate",
                    "--dynamic-sampling-filter-path", FILTER, "--over-sampling-batch-size", "24")
    wait_job_gone(job_id, timeout_s=600)
    assert status(job_dir)["stop_reason"] == "completed"
    rows = [json.loads(line) for line in (job_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["samples"] for r in rows] == [16 * 8] * 10  # every rollout filled: groups the filter dropped
    rewards = [r["reward_mean"] for r in rows]           # were replaced, or kept when too few remained
    assert rewards[0] < 0.3 and max(rewards[-3:]) > 0.5, rewards
