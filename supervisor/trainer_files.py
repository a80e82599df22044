"""What the supervisor judges from the trainer's files in the job dir (contract/job_dir.py): how long
the trainer needs to reach its next rollout boundary and save there."""

from __future__ import annotations

from contract.job_dir import JobDir, Metric, read_metrics

_STEP_SECONDS = (Metric.ROLLOUT_SECONDS, Metric.TRAIN_SECONDS, Metric.PUBLISH_SECONDS)
_RECENT = 20  # metrics lines to look back over


def seconds_to_boundary(job_dir: JobDir) -> float:
    """A rollout plus a save, as the last rollouts took them (0 before the first one): how long
    the trainer may need to reach its next rollout boundary and save there."""
    recent = read_metrics(job_dir, _RECENT)
    if not recent:
        return 0.0
    step = sum(float(recent[-1].get(k, 0.0)) for k in _STEP_SECONDS)
    return step + max(float(m.get(Metric.SAVE_SECONDS, 0.0)) for m in recent)
