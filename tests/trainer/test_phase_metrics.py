"""The GPU figures a user reads on each rollout's metrics line (issue 30, item 5), without a GPU:
each phase's time, the train step's tokens/s, the publish's time and bytes; and each phase's peak
GPU memory, with a fake GPU standing in for torch.cuda's counters (on a real one:
tests/gpu/test_gpu_job.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from contract.job_dir import PHASE_PEAK_GPU_MEMORY, PHASE_TIMES, Metric
from rollout.cpu_engine.weights import read_safetensors_folder
from tests.trainer.test_loop_parts import ROLLOUTS, FakeBackend, FakeSource, Lines, build
from trainer.phase_memory import PhaseMemory
from trainer.publish import WeightPublisher

GIB = 1024**3
TOKENS_PER_ROLLOUT = 4 * 5  # FakeSource: 4 samples of 5 tokens (prompt and response)


def test_each_line_has_phase_times_train_tokens_per_s_and_publish_bytes(tmp_path: Path) -> None:
    job_dir = tmp_path / "job"
    transport = WeightPublisher("disk", job_dir, tmp_path / "model_files", None)  # no engines: a folder per version
    reporter = Lines()
    loop = build(FakeBackend(), FakeSource(), reporter, tmp_path / "ckpt", transport=transport)
    loop.start(None, None)
    loop.run()
    lines = [reporter.lines[r] for r in range(ROLLOUTS)]
    for line in lines:
        assert all(line[key] >= 0 for key in PHASE_TIMES.values()), line
        assert line[PHASE_TIMES["rollout"]] > 0 and line[PHASE_TIMES["train"]] > 0
        # tokens over the optimizer steps' own time, which the train phase contains
        assert 0 < TOKENS_PER_ROLLOUT / line[Metric.TRAIN_TOKENS_PER_S] <= line[PHASE_TIMES["train"]], line
        folder = job_dir / "weights" / str(line["published_version"])
        published = read_safetensors_folder(folder)  # the weights' bytes, whatever the transport's framing
        assert line[Metric.PUBLISH_BYTES] == sum(t.numel() * t.element_size() for t in published.values()) > 0
        assert line[PHASE_TIMES["publish"]] > 0
    assert not any(key in line for line in lines for pair in PHASE_PEAK_GPU_MEMORY.values() for key in pair), \
        "no GPU: no memory figures"


def test_each_line_has_slimes_tflops_and_wait_time_ratio(tmp_path: Path) -> None:
    reporter = Lines()
    tera_per_token = 1e12  # a model of 1 TFLOP per token forward: the TFLOP/s are the tokens/s times 1 (or 3)
    loop = build(FakeBackend(), FakeSource(), reporter, None, fwd_flops=lambda lens: tera_per_token * sum(lens))
    loop.start(None, None)
    loop.run()
    for line in (reporter.lines[r] for r in range(ROLLOUTS)):
        # forward + backward (2x) over the optimizer steps' own time, on world_size 1
        assert line[Metric.TRAIN_TFLOPS] == pytest.approx(3 * line[Metric.TRAIN_TOKENS_PER_S])
        assert line[Metric.LOG_PROBS_TFLOPS] == pytest.approx(TOKENS_PER_ROLLOUT / line[PHASE_TIMES["log_probs"]])
        # the wait since the last train step holds this rollout's generation, and the train step is not in it
        rollout, train = line[PHASE_TIMES["rollout"]], line[Metric.TRAIN_SECONDS]
        assert rollout / (rollout + train) <= line[Metric.WAIT_TIME_RATIO] < 1, line


class FakeGpu:
    """torch.cuda's counters for one process beside OTHER bytes of another's: the backend's calls
    allocate (log-probs 1 GiB, an optimizer step 3 GiB) and free down to a resident 0.5 GiB."""

    OTHER = 2 * GIB

    def __init__(self) -> None:
        self.now = self.peak = GIB // 2

    def hold(self, nbytes: int) -> None:
        self.now = nbytes
        self.peak = max(self.peak, nbytes)

    def begin(self) -> None:
        self.peak = self.now

    def own_peak(self) -> int:
        return self.peak

    def used(self) -> int:
        return self.OTHER + self.peak  # the most the GPU held since begin(), whenever it is sampled


class AllocatingBackend(FakeBackend):
    def __init__(self, gpu: FakeGpu) -> None:
        super().__init__()
        self.gpu = gpu

    def log_probs(self, *args: Any, **kwargs: Any) -> dict[int, tuple[torch.Tensor, torch.Tensor | None]]:
        self.gpu.hold(GIB)
        out = super().log_probs(*args, **kwargs)
        self.gpu.hold(GIB // 2)
        return out

    def train_step(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        self.gpu.hold(3 * GIB)
        out = super().train_step(*args, **kwargs)
        self.gpu.hold(GIB // 2)
        return out


def test_each_phase_gets_its_own_peak_gpu_memory(tmp_path: Path) -> None:
    gpu = FakeGpu()
    reporter = Lines()
    loop = build(AllocatingBackend(gpu), FakeSource(), reporter, tmp_path / "ckpt", memory=PhaseMemory(gpu))
    loop.start(None, None)
    loop.run()
    for rollout_id, line in reporter.lines.items():
        own = {phase: line.get(PHASE_PEAK_GPU_MEMORY[phase][0]) for phase in PHASE_TIMES}
        used = {phase: line.get(PHASE_PEAK_GPU_MEMORY[phase][1]) for phase in PHASE_TIMES}
        saved = Metric.SAVE_SECONDS in line  # --save-interval 2, and the last rollout
        assert own == {"rollout": 0.5, "log_probs": 1.0, "train": 3.0, "publish": 0.5, "eval": None,
                       "save": 0.5 if saved else None}, (rollout_id, own)
        assert used == {phase: None if value is None else value + 2.0 for phase, value in own.items()}, used


def test_phase_memory_keeps_the_larger_peak_of_a_repeated_phase_and_forgets_on_take() -> None:
    gpu = FakeGpu()
    memory = PhaseMemory(gpu, sample_s=0.001)
    with memory.phase("save"):
        gpu.hold(4 * GIB)
    gpu.hold(GIB // 2)
    with memory.phase("save"):
        gpu.hold(GIB)
    with memory.phase("eval"):
        pass
    memory.forget("eval")
    assert memory.take() == {PHASE_PEAK_GPU_MEMORY["save"][0]: 4.0, PHASE_PEAK_GPU_MEMORY["save"][1]: 6.0}
    assert memory.take() == {}
    with pytest.raises(ValueError, match="unknown phase 'warmup'"):
        with memory.phase("warmup"):
            pass
