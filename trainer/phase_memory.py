"""Peak GPU memory of each phase of a rollout (rollout, log-probs, train, publish, eval, save), for
the rollout's metrics line (contract.PHASE_PEAK_GPU_MEMORY's keys), on a trainer with a GPU.

Two figures per phase, in GiB: the trainer rank's own peak (torch's max_memory_allocated, reset as
the phase begins: exact, its tensors only), and the GPU's peak use by every process on it (total
minus free, sampled every PEAK_SAMPLE_S while the phase runs: colocated engines and the CUDA
contexts included, what an OOM is about). Without a GPU the loop measures nothing and the line gets
no memory keys.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol

import torch

from contract.job_dir import PHASE_PEAK_GPU_MEMORY

PEAK_SAMPLE_S = 0.05  # seconds between two samples of the GPU's use while a phase runs
_GIB = 1024**3


class MemoryReader(Protocol):
    """What the GPU tells (torch.cuda's, in bytes); tests give their own."""

    def begin(self) -> None:
        """Start a phase: this process's peak counts from now."""

    def own_peak(self) -> int:
        """This process's most allocated since begin()."""

    def used(self) -> int:
        """What every process on the GPU uses now."""


class CudaReader:
    def __init__(self, device: torch.device) -> None:
        self.device = device

    def begin(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)

    def own_peak(self) -> int:
        torch.cuda.synchronize(self.device)  # the phase's kernels have allocated what they will
        return torch.cuda.max_memory_allocated(self.device)

    def used(self) -> int:
        free, total = torch.cuda.mem_get_info(self.device)
        return total - free


class PhaseMemory:
    def __init__(self, reader: MemoryReader | None, sample_s: float = PEAK_SAMPLE_S) -> None:
        """reader None: no GPU, nothing measured."""
        self.reader = reader
        self.sample_s = sample_s
        self._peaks: dict[str, tuple[int, int]] = {}  # phase -> (own peak, GPU's peak use), since take()

    @classmethod
    def of_this_process(cls) -> PhaseMemory:
        """The trainer's GPU, as the trainer uses one (trainer/dist_env.py): where CUDA is present."""
        if not torch.cuda.is_available():
            return cls(None)
        return cls(CudaReader(torch.device("cuda", torch.cuda.current_device())))

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Measure the block as phase `name` (a PHASE_PEAK_GPU_MEMORY key); a phase measured twice
        before take() keeps the larger peaks."""
        reader = self.reader
        if reader is None:
            yield
            return
        if name not in PHASE_PEAK_GPU_MEMORY:
            raise ValueError(f"unknown phase {name!r}; one of {', '.join(PHASE_PEAK_GPU_MEMORY)}")
        reader.begin()
        sampler = _PeakUse(reader, self.sample_s)
        try:
            yield
        finally:
            own, used = reader.own_peak(), sampler.stop()
            before = self._peaks.get(name, (0, 0))
            self._peaks[name] = (max(before[0], own), max(before[1], used))

    def forget(self, name: str) -> None:
        """Drop phase `name`'s figures since the last take (it turned out not to run)."""
        self._peaks.pop(name, None)

    def take(self) -> dict[str, float]:
        """The peaks measured since the last take, as metrics (GiB); then forgets them."""
        out: dict[str, float] = {}
        for name, (own, used) in self._peaks.items():
            own_key, used_key = PHASE_PEAK_GPU_MEMORY[name]
            out[own_key], out[used_key] = own / _GIB, used / _GIB
        self._peaks.clear()
        return out


class _PeakUse:
    """The largest reader.used() seen from now until stop(), sampled on a thread of its own."""

    def __init__(self, reader: MemoryReader, sample_s: float) -> None:
        self.reader = reader
        self.sample_s = sample_s
        self.peak = reader.used()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="phase-memory", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stopped.wait(self.sample_s):
            self.peak = max(self.peak, self.reader.used())

    def stop(self) -> int:
        self._stopped.set()
        self._thread.join()
        return max(self.peak, self.reader.used())
