"""slurmrl profile --train on the trainer's side: an armed TrainProfiler records exactly the next
N optimizer steps into rank{R}.trace.json.gz, nothing before it is armed, and a run that ends
early still writes what it recorded."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import torch

from trainer.profiling import TRAIN_STEP, TrainProfiler


def optimizer_step(profiler: TrainProfiler, name: str) -> None:
    with profiler.step(name):
        x = torch.randn(8, 8, requires_grad=True)
        (x @ x).sum().backward()
    profiler.after_step()


def steps_in(trace: Path) -> list[str]:
    with gzip.open(trace, "rt") as f:
        events = json.load(f)["traceEvents"]
    return [e["name"].removeprefix(TRAIN_STEP + " ") for e in events
            if str(e.get("name", "")).startswith(TRAIN_STEP) and e.get("ph") == "X"]


def test_an_armed_profiler_records_exactly_the_next_n_steps(tmp_path: Path) -> None:
    profiler = TrainProfiler(rank=3)
    optimizer_step(profiler, "s0")  # not armed: nothing recorded, nothing written
    assert not tmp_path.joinpath("p").exists()
    profiler.arm({"dir": str(tmp_path / "p"), "steps": 2})
    for name in ("s1", "s2", "s3"):
        optimizer_step(profiler, name)
    trace = tmp_path / "p" / "rank3.trace.json.gz"
    assert steps_in(trace) == ["s1", "s2"]
    profiler.close()  # nothing running: nothing rewritten
    assert steps_in(trace) == ["s1", "s2"]


def test_a_run_that_ends_early_writes_what_it_recorded(tmp_path: Path) -> None:
    profiler = TrainProfiler(rank=0)
    profiler.arm({"dir": str(tmp_path), "steps": 5})
    optimizer_step(profiler, "only")
    assert not (tmp_path / "rank0.trace.json.gz").exists()
    profiler.close()
    assert steps_in(tmp_path / "rank0.trace.json.gz") == ["only"]
