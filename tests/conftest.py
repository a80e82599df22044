"""Shared fixtures. `devcluster` brings a SLURM devcluster up once per session (or reuses one that
is already running), each node in its own network namespace where that is allowed, and points
SLURM_CONF at it.

Under pytest-xdist each worker has a devcluster of its own, so the SLURM tests, the suite's
critical path, run in every worker at once instead of all in one. gw0 (and a run without xdist)
uses the usual one at DEFAULT_ROOT, which people and `flock /tmp/devcluster.lock` runs share;
worker gwN one beside it (DEFAULT_ROOT-gwN) on its own ports and node names (an isolated
cluster's node names are in /etc/hosts: two clusters need two). With `--dist loadgroup` the
SLURM tests are grouped by file, so that a file's module-scoped job runs once, in one worker, and
the files spread over the workers. Where network namespaces are
refused every node of every cluster is 127.0.0.1 and the ports of a job come from its id, which
each cluster counts from 1: the SLURM tests then run in one group, in one worker, as before."""

from __future__ import annotations

import importlib.util
import os
import shutil
import string
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from slurm.devcluster import DevCluster, netns
from slurm.devcluster.config import DEFAULT_PORT_BASE, DEFAULT_ROOT, ClusterShape
from slurm.devcluster.daemons import DevclusterError
from slurm.devcluster.install import REQUIRED_PROGRAMS, ensure_installed
from slurm.devcluster.netns import IP_MISSING, NAMESPACES_REFUSED

SLURM_DIRS = ("integration", "slurm")  # test folders whose every test runs SLURM or a devcluster
# Worker gwN's cluster has ports DEFAULT_PORT_BASE - N * this and up (a cluster takes 20 + MAX_NODES):
# below the default cluster's, clear of the clusters tests bring up themselves (18800 and up) and of
# tests/ports.py's (20000 and up).
WORKER_PORT_STRIDE = 100


def pytest_configure(config: pytest.Config) -> None:
    # transformers' Qwen3-Next takes fla's Triton kernels wherever fla is installed (a GPU machine's), CPU
    # tensors or not: the tests' transformers references run on the CPU
    if importlib.util.find_spec("fla") or importlib.util.find_spec("causal_conv1d"):
        from ckpt_tools.hf_cpu_kernels import use_torch_kernels

        use_torch_kernels()


def pytest_sessionfinish() -> None:
    if "tests.rank_devices" in sys.modules:  # it started ranks: stop the server they were forked from
        sys.modules["tests.rank_devices"].stop_rank_server()


def _worker() -> int:
    """This xdist worker's number (gw3 -> 3); 0 without xdist."""
    return int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))


def _per_file_groups() -> bool:
    """Whether the clusters of two workers can run jobs at once: only with a namespace per node."""
    try:
        netns.check_allowed()
    except DevclusterError:
        return False
    return True


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which groups by the markers it finds
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    per_file = "PYTEST_XDIST_WORKER" in os.environ and _per_file_groups()
    for item in items:
        if "slurm_programs" in item.fixturenames or item.path.parent.name in SLURM_DIRS:
            group = f"slurm:{item.nodeid.split('::')[0]}" if per_file else "slurm"
            item.add_marker(pytest.mark.xdist_group(group))
        elif _shares_a_module_fixture(item):
            item.add_marker(pytest.mark.xdist_group(f"module:{item.nodeid.split('::')[0]}"))


def _shares_a_module_fixture(item: pytest.Item) -> bool:
    """Whether the test uses a fixture made once per module (or class): its file's tests then run
    in one worker, else each worker that gets one of them builds the fixture again (a megatron
    layouts fixture of minutes was built twice)."""
    defs = getattr(item, "_fixtureinfo", None)
    return defs is not None and any(d.scope in ("module", "class", "package")
                                    for fixture in defs.name2fixturedefs.values() for d in fixture)


@pytest.fixture(scope="session")
def slurm_programs() -> None:
    """SLURM, munge and MariaDB installed (apt-get, once), or the test skipped where they cannot be
    (a GPU machine with no network)."""
    try:
        ensure_installed()
    except DevclusterError as err:
        missing = [p for p in REQUIRED_PROGRAMS if not shutil.which(p)]
        pytest.skip(f"no SLURM here ({', '.join(missing)} missing, and could not be installed: {str(err)[:200]})")


def worker_cluster(worker: int) -> tuple[Path, ClusterShape | None]:
    """xdist worker gw<worker>'s cluster: its --dir, and a shape whose ports and node names are its
    own, what `up` is told (None for gw0's, which keeps the shape it was last brought up with, as
    `slurmrl cluster up` does)."""
    if worker == 0:
        return DEFAULT_ROOT, None
    letters = "".join(string.ascii_lowercase[int(digit)] for digit in str(worker))  # a prefix takes no digits
    return (DEFAULT_ROOT.with_name(f"{DEFAULT_ROOT.name}-gw{worker}"),
            ClusterShape(port_base=DEFAULT_PORT_BASE - worker * WORKER_PORT_STRIDE, node_prefix=f"node-{letters}"))


def _up(root: Path, shape: ClusterShape | None, network: str) -> subprocess.CompletedProcess[str]:
    flags = ["--port-base", str(shape.port_base), "--node-prefix", shape.node_prefix] if shape else []
    # Fake GPUs on a GPU machine too: the toy jobs ask for more GPUs than it has (tests/gpu bring
    # up clusters of their own with --gpus real).
    return subprocess.run([sys.executable, "-m", "slurm.devcluster", "up", network, "--gpus", "fake", "--dir",
                           str(root), *flags], capture_output=True, text=True)


@pytest.fixture(scope="session")
def devcluster(slurm_programs) -> Iterator[DevCluster]:
    root, shape = worker_cluster(_worker())
    was_running = all(d.is_running() for d in DevCluster(root).daemons())
    # Isolated (a network namespace per node) as `slurmrl cluster up` is by default; where namespaces
    # are not allowed, shared loopback, and the tests that need namespaces skip themselves.
    up = _up(root, shape, "--isolated")
    if up.returncode != 0 and (NAMESPACES_REFUSED in up.stderr or IP_MISSING in up.stderr):
        up = _up(root, shape, "--shared-loopback")
    if up.returncode != 0:
        pytest.fail(f"devcluster did not come up:\n{up.stderr}")
    cluster = DevCluster(root)
    previous = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(cluster.paths.slurm_conf)
    yield cluster
    if previous is None:
        os.environ.pop("SLURM_CONF")
    else:
        os.environ["SLURM_CONF"] = previous
    if not was_running:
        subprocess.run([sys.executable, "-m", "slurm.devcluster", "down", "--dir", str(root)], check=True)


@pytest.fixture(scope="session")
def tiny_megatron(tmp_path_factory) -> tuple[Path, Path]:
    """The tiny HF model (seed 0) and its torch_dist checkpoint, made once per worker for the Megatron
    tests, which only read them (a trainer saves elsewhere)."""
    from ckpt_tools.convert import hf_to_torch_dist
    from rollout.tiny_model import write_tiny_model

    root = tmp_path_factory.mktemp("tiny_megatron")
    model = write_tiny_model(root / "model", seed=0)
    return model, hf_to_torch_dist(model, root / "torch_dist", iteration=None, progress=False)
