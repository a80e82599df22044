"""`slurmrl profile JOB --train --steps N` on the trainer's side: the torch profiler over the next
N optimizer steps of every rank, one Chrome trace per rank, `rank{R}.trace.json.gz` in the folder
the supervisor named (JOB_DIR/profiles/train-STAMP/). The request arrives with rank 0's poll
between rollouts and is broadcast to every rank, so all ranks profile the same steps. Each
optimizer step is one `train_step` range in the trace, and within it each phase of the step (`phase`)
one range of its own: the packs' forward and backward, the gradient reduce, the norm, the optimizer."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from trainer.memory_history import MemoryHistory

log = logging.getLogger(__name__)

TRAIN_STEP = "slurmrl.train_step"
PHASE = "slurmrl.phase"  # a range's name prefix: "slurmrl.phase packs", ...


def phase(name: str) -> torch.profiler.record_function:
    """One phase of a training step, a range in a profile's trace (a few microseconds unprofiled)."""
    return torch.profiler.record_function(f"{PHASE} {name}")


class TrainProfiler:
    def __init__(self, rank: int, memory: MemoryHistory | None = None) -> None:
        """memory: --record-memory-history's recorder, told when each rollout is done."""
        self.rank = rank
        self.memory = memory
        self._request: dict[str, Any] | None = None  # armed, not started yet
        self._profiler: torch.profiler.profile | None = None
        self._path: Path | None = None
        self._left = 0

    def arm(self, request: dict[str, Any]) -> None:
        """{"dir": folder, "steps": N}: profile the next N optimizer steps (a profile still running
        is written first)."""
        if self._profiler is not None:
            self._finish()
        self._request = request

    def step(self, name: str) -> torch.profiler.record_function:
        """Around one optimizer step: starts an armed profile, and marks the step in the trace."""
        if self._request is not None:
            request, self._request = self._request, None
            folder = Path(request["dir"])
            folder.mkdir(parents=True, exist_ok=True)
            self._path, self._left = folder / f"rank{self.rank}.trace.json.gz", int(request["steps"])
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._profiler = torch.profiler.profile(activities=activities, record_shapes=True)
            self._profiler.start()
            log.info("profiling the next %d training steps into %s", self._left, self._path)
        return torch.profiler.record_function(f"{TRAIN_STEP} {name}")

    def after_step(self) -> None:
        if self._profiler is not None:
            self._left -= 1
            if self._left <= 0:
                self._finish()

    def after_rollout(self, rollout_id: int) -> None:
        if self.memory is not None:
            self.memory.after_rollout(rollout_id)

    def close(self) -> None:
        """The run ends before N steps: write what was recorded."""
        if self._profiler is not None:
            self._finish()

    def _finish(self) -> None:
        assert self._profiler is not None and self._path is not None
        profiler, self._profiler = self._profiler, None
        profiler.stop()
        profiler.export_chrome_trace(str(self._path))
        log.info("training profile written to %s", self._path)
