"""`slurmrl cluster` refuses bad input with a one-line error, a non-zero exit and no files."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from slurm.devcluster.config import DEFAULT_ROOT, MAX_NODES, ClusterPaths, ClusterShape, load_shape, save_shape
from tests.conftest import worker_cluster


def _cluster(*args: str, prefix: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*prefix, sys.executable, "-m", "slurm.devcluster", *args],
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(("flag", "value", "expected"), [
    ("--nodes", "0", f"--nodes must be between 1 and {MAX_NODES}, got 0"),
    ("--nodes", "65", f"--nodes must be between 1 and {MAX_NODES}, got 65"),
    ("--gpus-per-node", "-1", "--gpus-per-node must be 0 or more, got -1"),
    ("--cpus-per-node", "0", "--cpus-per-node must be 1 or more, got 0"),
    ("--port-base", "80", "--port-base must be between 1024"),
    ("--node-prefix", "Node", "--node-prefix must be 1 to 16 lowercase letters"),
])
def test_bad_shape_is_a_clear_error_and_writes_nothing(tmp_path: Path, flag: str, value: str, expected: str) -> None:
    root = tmp_path / "cluster"
    result = _cluster("up", "--dir", str(root), flag, value)
    assert result.returncode == 1
    assert result.stderr.count("\n") == 1 and expected in result.stderr
    assert not root.exists()


def test_not_root_is_a_clear_error_and_writes_nothing(tmp_path: Path) -> None:
    # A user namespace without a uid mapping runs us as uid 65534, the overflow user.
    if subprocess.run(["unshare", "--user", "true"], capture_output=True).returncode != 0:
        pytest.skip("unshare --user is not permitted here, so no non-root process can be made")
    root = tmp_path / "cluster"
    result = _cluster("up", "--dir", str(root), prefix=("unshare", "--user"))
    assert result.returncode == 1
    assert "must run as root" in result.stderr and result.stderr.count("\n") == 1
    assert not root.exists()


def test_unknown_action_is_a_usage_error() -> None:
    result = _cluster("start")
    assert result.returncode == 2 and "invalid choice: 'start'" in result.stderr


def test_every_daemon_gets_its_own_port_even_at_the_node_limit() -> None:
    ports = ClusterShape(nodes=MAX_NODES).all_ports()
    assert len(set(ports.values())) == len(ports) == MAX_NODES + 3
    assert max(ports.values()) <= 65535


def test_each_test_worker_has_a_cluster_of_its_own() -> None:
    """tests/conftest.py: gw0 uses the default devcluster; every other xdist worker one with its own
    --dir, ports (none shared, at the node limit) and node names (in /etc/hosts for all clusters)."""
    assert worker_cluster(0) == (DEFAULT_ROOT, None)
    clusters = dict(worker_cluster(k) for k in range(1, 33))
    shapes = [ClusterShape(nodes=MAX_NODES), *(replace(s, nodes=MAX_NODES) for s in clusters.values() if s)]
    for shape in shapes:
        shape.validate()
    ports = [port for shape in shapes for port in shape.all_ports().values()]
    names = [name for shape in shapes for name in shape.node_names]
    assert len(clusters) == 32 and DEFAULT_ROOT not in clusters
    assert len(set(ports)) == len(ports) and len(set(names)) == len(names)


def test_shapes_within_limits_validate() -> None:
    ClusterShape(nodes=1, gpus_per_node=0).validate()
    ClusterShape(nodes=MAX_NODES).validate()


@pytest.mark.skipif(not (shutil.which("ip") and shutil.which("setpriv")), reason="needs iproute2 and setpriv")
def test_up_isolated_refuses_in_one_line_where_namespaces_are_not_allowed(tmp_path: Path) -> None:
    # Refused before anything is installed or started (on a machine without SLURM, too).
    # Root without capabilities (an empty bounding set): `ip netns add` is refused by the kernel.
    root = tmp_path / "dc"
    up = subprocess.run(["setpriv", "--bounding-set=-all", "--inh-caps=-all", sys.executable, "-m", "slurm.devcluster",
                         "up", "--isolated", "--dir", str(root), "--nodes", "2", "--port-base", "19150"],
                        capture_output=True, text=True, timeout=60)
    assert up.returncode == 1
    assert up.stderr.count("\n") == 1 and "network namespaces are not allowed here" in up.stderr, up.stderr
    assert "--shared-loopback" in up.stderr
    assert not root.exists()
    leftovers = [subprocess.run(["ip", *argv], capture_output=True, text=True).stdout for argv in (["netns"], ["link"])]
    assert "srl-19150" not in "".join(leftovers) + Path("/etc/hosts").read_text()


def test_shape_file_from_before_namespaces_is_a_shared_loopback_cluster(tmp_path: Path) -> None:
    # A cluster.json written before namespaces were the default has no "isolated" key.
    paths = ClusterPaths(tmp_path)
    old = {"nodes": 4, "gpus_per_node": 4, "cpus_per_node": 8, "memory_mb_per_node": 16384, "port_base": 17800}
    paths.shape_file.parent.mkdir(parents=True, exist_ok=True)
    paths.shape_file.write_text(json.dumps(old))
    assert load_shape(paths) == ClusterShape(isolated=False)
    for shape in (ClusterShape(nodes=2), ClusterShape(nodes=2, isolated=False)):
        save_shape(paths, shape)
        assert load_shape(paths) == shape
