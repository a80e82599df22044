"""What the supervisor reads of the trainer's own files in the job dir: the heartbeat (its phase
and when it last moved; trainer/metrics.py writes it) and metrics.jsonl (how long a rollout and a
save take, to judge whether a preemption grace still covers the next rollout boundary)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

HEARTBEAT_FILE = "trainer_heartbeat.json"
METRICS_FILE = "metrics.jsonl"
_STEP_SECONDS = ("rollout_seconds", "train_seconds", "publish_seconds")
_RECENT = 20  # metrics lines to look back over


@dataclass(frozen=True)
class Heartbeat:
    phase: str  # start | rollout | train | publish | save
    since: float  # unix time of the last beat
    rollout_id: int | None


def read_heartbeat(job_dir: Path, launched: float) -> Heartbeat:
    """The trainer's latest beat if it came from the launch at `launched`; before that beat (or
    with an unreadable file) the trainer is starting, since its launch."""
    try:
        beat = json.loads((job_dir / HEARTBEAT_FILE).read_text())
        if float(beat["time"]) >= launched:
            return Heartbeat(str(beat["phase"]), float(beat["time"]), beat.get("rollout_id"))
    except (OSError, ValueError, KeyError, TypeError):
        pass  # not written yet, or a predecessor's
    return Heartbeat("start", launched, None)


def seconds_to_boundary(job_dir: Path) -> float:
    """A rollout plus a save, as the last rollouts took them (0 before the first one): how long
    the trainer may need to reach its next rollout boundary and save there."""
    try:
        lines = (job_dir / METRICS_FILE).read_text().splitlines()[-_RECENT:]
        recent = [json.loads(line) for line in lines if line.strip()]
    except (OSError, ValueError):
        return 0.0
    if not recent:
        return 0.0
    step = sum(float(recent[-1].get(k, 0.0)) for k in _STEP_SECONDS)
    return step + max(float(m.get("save_seconds", 0.0)) for m in recent)
