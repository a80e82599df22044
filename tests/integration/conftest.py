"""Fixtures of the devcluster job tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollout.tiny_model import write_tiny_model
from rollout.toy_task import write_toy_data


@pytest.fixture(scope="session")
def toy(tmp_path_factory) -> tuple[Path, Path]:
    """The tiny model and the toy prompts every toy job uses."""
    root = tmp_path_factory.mktemp("toy")
    return write_tiny_model(root / "model"), write_toy_data(root / "toy.jsonl")
