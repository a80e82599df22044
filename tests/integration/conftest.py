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


HEALED_ANSWERS_S = 20  # a healed node's slurmd answering SLURM again, as it mostly does at once
NODES_BACK_S = 60  # a restarted slurmd's node in service again


@pytest.fixture
def isolated_devcluster(devcluster: DevCluster) -> Iterator[DevCluster]:
    """The session's devcluster, for a test that needs its nodes in their own network namespaces
    (skipped where namespaces are not allowed). After the test every node is healed and in service
    again (a node cut off long enough is set DOWN by SLURM, and may stay so after it answers
    again): the next test gets the whole cluster."""
    if devcluster.net is None:
        pytest.skip("the devcluster shares loopback here: network namespaces are not allowed")
    yield devcluster
    heal_all(devcluster.paths.root)
    try:
        devcluster.back_in_service(devcluster.shape.node_names, HEALED_ANSWERS_S)
    except TimeoutError:
        # A slurmd that was cut off can take minutes to register again (seen: 2.5): a fresh one
        # registers at once (its node's steps, if any, live on under their slurmstepd).
        for node, state in devcluster.node_states().items():
            if state not in ("idle", "mix", "alloc"):
                devcluster.kill_slurmd(node)
                devcluster.revive_slurmd(node, NODES_BACK_S)
