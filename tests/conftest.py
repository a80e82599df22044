"""Shared fixtures. `devcluster` brings the SLURM devcluster up once per session (or reuses one
that is already running), each node in its own network namespace where that is allowed, and points
SLURM_CONF at it.

Under pytest-xdist (`--dist loadgroup`), every test that touches SLURM runs in one worker: one
worker's session could otherwise take the cluster down under another's job."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator

import pytest

from slurm.devcluster import DevCluster
from slurm.devcluster.cluster import REQUIRED_PROGRAMS, ensure_installed
from slurm.devcluster.config import DEFAULT_ROOT
from slurm.devcluster.daemons import DevclusterError
from slurm.devcluster.netns import IP_MISSING, NAMESPACES_REFUSED


SLURM_DIRS = ("integration", "slurm")  # test folders whose every test runs SLURM or a devcluster


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which groups by the markers it finds
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "slurm_programs" in item.fixturenames or item.path.parent.name in SLURM_DIRS:
            item.add_marker(pytest.mark.xdist_group("slurm"))


@pytest.fixture(scope="session")
def slurm_programs() -> None:
    """SLURM, munge and MariaDB installed (apt-get, once), or the test skipped where they cannot be
    (a GPU machine with no network)."""
    try:
        ensure_installed()
    except DevclusterError as err:
        missing = [p for p in REQUIRED_PROGRAMS if not shutil.which(p)]
        pytest.skip(f"no SLURM here ({', '.join(missing)} missing, and could not be installed: {str(err)[:200]})")


def _up(network: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "slurm.devcluster", "up", network, "--dir", str(DEFAULT_ROOT)],
                          capture_output=True, text=True)


@pytest.fixture(scope="session")
def devcluster(slurm_programs) -> Iterator[DevCluster]:
    cluster = DevCluster(DEFAULT_ROOT)
    was_running = all(d.is_running() for d in cluster.daemons())
    # Isolated (a network namespace per node) as `slurmrl cluster up` is by default; where namespaces
    # are not allowed, shared loopback, and the tests that need namespaces skip themselves.
    up = _up("--isolated")
    if up.returncode != 0 and (NAMESPACES_REFUSED in up.stderr or IP_MISSING in up.stderr):
        up = _up("--shared-loopback")
    if up.returncode != 0:
        pytest.fail(f"devcluster did not come up:\n{up.stderr}")
    cluster = DevCluster(DEFAULT_ROOT)
    previous = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(cluster.paths.slurm_conf)
    yield cluster
    if previous is None:
        os.environ.pop("SLURM_CONF")
    else:
        os.environ["SLURM_CONF"] = previous
    if not was_running:
        subprocess.run([sys.executable, "-m", "slurm.devcluster", "down", "--dir", str(DEFAULT_ROOT)], check=True)
