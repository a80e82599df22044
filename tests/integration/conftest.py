"""Fixtures of the devcluster job tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from rollout.tiny_model import write_tiny_model
from rollout.toy_task import write_toy_data
from slurm.devcluster import DevCluster
from slurm.devcluster.faults import heal_all


@pytest.fixture(scope="session")
def toy(tmp_path_factory) -> tuple[Path, Path]:
    """The tiny model and the toy prompts every toy job uses."""
    root = tmp_path_factory.mktemp("toy")
    return write_tiny_model(root / "model"), write_toy_data(root / "toy.jsonl")


@pytest.fixture(scope="module")
def isolated_devcluster(devcluster: DevCluster) -> Iterator[DevCluster]:
    """The session's devcluster, for a module whose tests need its nodes in their own network
    namespaces (skipped where namespaces are not allowed); every node's network faults are healed
    after the module, whatever its tests left."""
    if devcluster.net is None:
        pytest.skip("the devcluster shares loopback here: network namespaces are not allowed")
    try:
        yield devcluster
    finally:
        heal_all(devcluster.paths.root)
