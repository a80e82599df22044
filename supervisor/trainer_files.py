"""What the supervisor judges from the trainer's files in the job dir (contract/job_dir.py) and its
checkpoint folder: how long the trainer's steps and saves take, and its last complete checkpoint."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from ckpt_tools.tracker import iteration_dirname, read_tracker
from contract.job_dir import Heartbeat, JobDir, Metric, Phase, read_metrics
from supervisor.deadline import StopCosts

_RECENT = 20  # metrics lines to look back over


class Pace:
    """The trainer's recent step and save times, read again from metrics.jsonl once it changed.
    The save time is the longest of the recent saves (the last one measured when none is recent),
    the training time (with its publish) the longest of the recent rollouts': a stop planned on the
    last one alone came too late when the next step ran slower (CI, a loaded machine)."""

    def __init__(self, job_dir: JobDir) -> None:
        self.job_dir = job_dir
        self._seen: tuple[int, int] | None = None  # (size, mtime_ns) of metrics.jsonl when last read
        self._costs = StopCosts(0.0, 0.0, 0.0)

    def costs(self, beat: Heartbeat | None) -> StopCosts:
        """The costs, with a save under way (beat: the trainer's heartbeat) as long as it has taken already."""
        self._read()
        costs = self._costs
        if beat is not None and beat.phase is Phase.SAVE:
            saving_for = time.time() - beat.began
            if saving_for > costs.save_s:
                costs = dataclasses.replace(costs, save_s=saving_for)
        return costs

    def _read(self) -> None:
        try:
            stat = self.job_dir.metrics.stat()
        except OSError:
            return
        if (stat.st_size, stat.st_mtime_ns) == self._seen:
            return
        self._seen = (stat.st_size, stat.st_mtime_ns)
        recent = read_metrics(self.job_dir, _RECENT)
        if not recent:
            return
        last = recent[-1]
        train = max(float(m.get(Metric.TRAIN_SECONDS, 0.0)) + float(m.get(Metric.PUBLISH_SECONDS, 0.0)) for m in recent)
        saves = [float(m[Metric.SAVE_SECONDS]) for m in recent if Metric.SAVE_SECONDS in m]
        save = max(saves) if saves else self._costs.save_s
        self._costs = StopCosts(save, train, float(last.get(Metric.ROLLOUT_SECONDS, 0.0)) + train + save)


def last_checkpoint(save: str | None) -> str | None:
    """The checkpoint folder --save's tracker names (the last complete one), or None."""
    try:
        iteration = read_tracker(Path(save)) if save else None
    except (FileNotFoundError, ValueError):
        return None
    return str(Path(save) / iteration_dirname(iteration)) if save and iteration is not None else None
