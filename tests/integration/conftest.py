"""Fixtures of the devcluster job tests."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollout.tiny_model import write_tiny_model
from rollout.toy_task import write_toy_data
from slurm.devcluster import DevCluster


@pytest.fixture(scope="session")
def toy(tmp_path_factory) -> tuple[Path, Path]:
    """The tiny model and the toy prompts every toy job uses."""
    root = tmp_path_factory.mktemp("toy")
    return write_tiny_model(root / "model"), write_toy_data(root / "toy.jsonl")


ISOLATED_PORT_BASE = 19300  # clear of the shared devcluster's (17800) and the other tests' (18800, 19100-19200)


@pytest.fixture(scope="module")
def isolated_devcluster(slurm_programs, tmp_path_factory) -> Iterator[DevCluster]:
    """An isolated devcluster (one network namespace per node) of the shared one's shape, for one
    module, with SLURM_CONF pointing at it meanwhile; brought down (every fault healed first) after.
    Its /etc/hosts lines map the node names the shared cluster uses too: the shared one must be
    idle meanwhile (the SLURM tests run one at a time, in one xdist worker)."""
    root = tmp_path_factory.mktemp("isolated") / "dc"
    up = _cluster("up", "--isolated", "--dir", str(root), "--port-base", str(ISOLATED_PORT_BASE))
    try:
        if "network namespaces are not allowed here" in up.stderr:
            pytest.skip(up.stderr.strip())
        assert up.returncode == 0, f"the isolated devcluster did not come up:\n{up.stderr}"
        cluster = DevCluster(root)
        previous = os.environ.get("SLURM_CONF")
        os.environ["SLURM_CONF"] = str(cluster.paths.slurm_conf)
        try:
            yield cluster
        finally:
            if previous is None:
                os.environ.pop("SLURM_CONF")
            else:
                os.environ["SLURM_CONF"] = previous
    finally:
        down = _cluster("down", "--dir", str(root))
        assert down.returncode == 0, down.stderr


def _cluster(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "slurm.devcluster", *argv], capture_output=True, text=True,
                          timeout=300)
