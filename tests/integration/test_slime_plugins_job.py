"""Plug-ins written for slime train a job on the devcluster: the seed doc's custom generate function
(verbatim, through slime's own `post`), wrapped to return a new Sample or a list of one as slime
allows, slime's dynamic-sampling filter, and a custom RM that raises for 1 sample in 50, by slime's
import paths. The job completes, every rollout is full, rewards rise, the RM's errors are counted in
metrics.jsonl and the first one is an event naming it. A second, short job's rollout function calls
a method slurmrl lacks: the job fails at once, without a trainer restart, naming the function and
its exception in `slurmrl status` and `slurmrl events`."""

from __future__ import annotations

import json
from pathlib import Path

from rollout.sample_errors import METRIC as SAMPLE_ERRORS
from tests.integration.test_rl_job import events, slurmrl, status, submit
from tests.rollout.slime_plugins import FLAKY_SAID
from tests.slurm_helpers import wait_job_gone

FILTER = "slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std_with_fallback"
RM = "tests.rollout.slime_plugins.flaky_toy_rm"
BROKEN_ROLLOUT = "tests.rollout.user_code_plugins.rollout_calls_a_missing_method"
JOB_S = 600  # the 10-rollout job, submission to its end
FAILING_JOB_S = 240  # the job whose first rollout fails: its start, one trainer start, its end


def test_slime_plugins_train_the_toy_job(devcluster, toy, tmp_path: Path) -> None:
    job_dir = tmp_path / "job"
    job_id = submit(toy, job_dir, "--num-rollout", "10",
                    "--custom-generate-function-path", "tests.rollout.slime_plugins.generate_new",
                    "--custom-rm-path", RM,
                    "--dynamic-sampling-filter-path", FILTER, "--over-sampling-batch-size", "24")
    wait_job_gone(job_id, timeout_s=JOB_S)
    assert status(job_dir)["stop_reason"] == "completed"
    rows = [json.loads(line) for line in (job_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["samples"] for r in rows] == [16 * 8] * 10  # every rollout filled: groups the filter dropped
    rewards = [r["reward_mean"] for r in rows]           # were replaced, or kept when too few remained
    assert rewards[0] < 0.3 and max(rewards[-3:]) > 0.5, rewards
    # Each of the RM's raises is counted, none ended a rollout; the first is an event with its exception.
    raised = (job_dir / "logs" / "trainer.log").read_text().count(FLAKY_SAID)
    assert raised > 0 and sum(r[SAMPLE_ERRORS] for r in rows) == raised
    [event] = events(job_dir, "plugin_error")
    assert event["plugin"] == f"--custom-rm-path {RM}" and event["error"].startswith("ValueError: cannot grade sample")
    assert not events(job_dir, "trainer_failed")


def test_a_users_function_failing_for_good_fails_the_job_at_once(devcluster, toy, tmp_path: Path) -> None:
    job_dir = tmp_path / "job"
    job_id = submit(toy, job_dir, "--num-rollout", "3", "--rollout-function-path", BROKEN_ROLLOUT)
    wait_job_gone(job_id, timeout_s=FAILING_JOB_S)
    cause = (f"--rollout-function-path {BROKEN_ROLLOUT} raised AttributeError: 'DataBuffer' object has no "
             "attribute 'get_samples_by_difficulty' in rollout 0")
    state = status(job_dir)
    assert state["stop_reason"] == f"failed: {cause}"
    assert state["steps"]["trainer"]["restarts"] == 0, "no restart into the same error"
    assert [(e["reason"], e["fatal"]) for e in events(job_dir, "trainer_failed")] == [(cause, True)]
    assert [e["reason"] for e in events(job_dir, "job_failed")] == [cause]
    assert cause in slurmrl("events", str(job_dir)).stdout
    assert cause in slurmrl("status", str(job_dir)).stdout
