"""Callables the Submitit tests run on the devcluster (pickled by value, so workers need not
import this module)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import submitit


def where_am_i(x: int) -> tuple[int, str]:
    return x * x, os.environ["SLURMD_NODENAME"]


class CountTo(submitit.helpers.Checkpointable):
    """Counts to `n`, one step every 0.2 s, recording progress in `progress_file`. On preemption
    it checkpoints the count reached, so the requeued run continues from there."""

    def __call__(self, n: int, progress_file: str, start: int = 0) -> dict[str, int]:
        progress = Path(progress_file)
        staged = progress.with_name(progress.name + ".tmp")
        for i in range(start, n):
            time.sleep(0.2)  # one step of "work"
            # replaced whole: the checkpoint (SIGUSR2's handler, run between any two steps of this loop)
            # would otherwise read a file truncated but not yet written (CI: "invalid literal ''")
            staged.write_text(str(i + 1))
            os.replace(staged, progress)
        return {"start": start, "restarts": int(os.environ.get("SLURM_RESTART_COUNT", "0")), "reached": n}

    def checkpoint(self, n: int, progress_file: str, start: int = 0) -> submitit.helpers.DelayedSubmission:
        reached = int(Path(progress_file).read_text())
        return submitit.helpers.DelayedSubmission(self, n, progress_file, reached)
