"""--record-memory-history on a GPU (trainer.memory_history): torch's CUDA allocator history is
recorded from the start and dumped, as a snapshot pytorch.org/memory_viz opens, after rollout
--memory-snapshot-num-steps - 1; recording then stops."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch

from trainer.memory_history import MemoryHistory

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_the_snapshot_holds_the_allocations_of_the_recorded_rollouts(tmp_path: Path) -> None:
    history = MemoryHistory(0, str(tmp_path), "snapshot.pickle", num_steps=2)
    kept = [torch.empty(1 << 20, device="cuda") for _ in range(3)]  # 4 MiB each, during rollout 0
    history.after_rollout(0)
    assert not list(tmp_path.iterdir())  # not yet: after rollout 1
    history.after_rollout(1)
    [path] = tmp_path.iterdir()
    snapshot = pickle.loads(path.read_bytes())
    events = [e for trace in snapshot["device_traces"] for e in trace if e["action"] == "alloc"]
    assert sum(e["size"] == 4 << 20 for e in events) >= len(kept)
    assert not history.recording
    del kept
