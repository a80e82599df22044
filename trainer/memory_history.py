"""--record-memory-history: torch's CUDA allocator history from when the loop is built (the models
and optimizers in memory), as slime's train_overall memory profiler records it. A snapshot (open
it at pytorch.org/memory_viz) is dumped after rollout --memory-snapshot-num-steps - 1, when
recording stops, and whenever the allocator runs out of memory, each rank's to
--memory-snapshot-dir as memory_snapshot_time<T>_rank<R>_<--memory-snapshot-path>. CUDA only
(submission refuses it on CPU)."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch

from trainer.args_actions import ArgsError
from trainer.config.device_checks import memory_history_problem

log = logging.getLogger(__name__)

MAX_ENTRIES = 1_000_000  # allocator events kept (slime's)


class MemoryHistory:
    def __init__(self, rank: int, snapshot_dir: str, snapshot_path: str, num_steps: int | None,
                 memory: Any = None) -> None:
        """memory: torch.cuda.memory (a test gives its own)."""
        if memory is None and not torch.cuda.is_available():
            raise ArgsError(memory_history_problem(True, "cpu") or "")
        self.memory = memory if memory is not None else torch.cuda.memory
        self.path = Path(snapshot_dir) / f"memory_snapshot_time{time.time()}_rank{rank}_{snapshot_path}"
        self.num_steps = num_steps
        self.recording = True
        self.memory._record_memory_history(max_entries=MAX_ENTRIES, stacks="all")
        attach = getattr(torch._C, "_cuda_attach_out_of_memory_observer", None)
        if attach is not None and memory is None:
            attach(self._on_out_of_memory)

    def _on_out_of_memory(self, device: int, alloc: int, device_alloc: int, device_free: int) -> None:
        log.error("CUDA out of memory on device %d (asked %d bytes, %d allocated, %d free): dumping the memory "
                  "history to %s", device, alloc, device_alloc, device_free, self.path)
        self._dump()

    def after_rollout(self, rollout_id: int) -> None:
        if self.recording and self.num_steps is not None and rollout_id == self.num_steps - 1:
            self._dump()
            self.memory._record_memory_history(enabled=None)
            self.recording = False

    def _dump(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.memory._dump_snapshot(str(self.path))
        log.info("memory snapshot written to %s", self.path)
