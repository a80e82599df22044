"""`up` is idempotent, refuses to reshape a running cluster, `down` stops exactly the processes
`up` started, by their PID files, and job ids go on past the accounting's after a reshape. Uses a
second, one-node cluster on other ports."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from slurm.devcluster import ClusterShape, DevCluster
from slurm.devcluster.daemons import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("slurm_programs")]
PORT_BASE = 18800
PREFIX = "life"  # its node names: the session's isolated cluster holds node1.. in /etc/hosts meanwhile


def _cluster(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "slurm.devcluster", *args], capture_output=True, text=True,
                          timeout=180)


def _pids(cluster: DevCluster) -> dict[str, int]:
    return {d.name: proc.pid for d in cluster.daemons() if (proc := d.process())}


def _submit_and_account(root: Path) -> int:
    """Submit a trivial job; its id once slurmdbd has recorded it."""
    env = {**os.environ, "SLURM_CONF": str(root / "etc" / "slurm.conf")}
    job_id = subprocess.run(["sbatch", "--parsable", "--wrap", "true"], env=env, capture_output=True, text=True,
                            timeout=60, check=True).stdout.strip()

    def accounted() -> bool:
        return bool(subprocess.run(["sacct", "-n", "-X", "-j", job_id, "-o", "JobIDRaw"], env=env,
                                   capture_output=True, text=True, timeout=60).stdout.strip())

    wait_for(accounted, 60, f"job {job_id} in the accounting")
    return int(job_id)


def test_up_is_idempotent_and_down_stops_exactly_what_up_started(tmp_path: Path) -> None:
    root = tmp_path / "dc"
    flags = ["--dir", str(root), "--nodes", "1", "--gpus-per-node", "0", "--port-base", str(PORT_BASE),
             "--node-prefix", PREFIX]
    # A process that is not the cluster's, named by a stale PID file: down must leave it alone.
    bystander = subprocess.Popen(["sleep", "300"])
    try:
        first = _cluster("up", *flags)
        assert first.returncode == 0, first.stderr
        assert f"export SLURM_CONF={root}/etc/slurm.conf" in first.stdout
        cluster = DevCluster(root)
        assert cluster.shape == ClusterShape(nodes=1, gpus_per_node=0, port_base=PORT_BASE, node_prefix=PREFIX)
        assert cluster.net is not None  # namespaces by default
        started = _pids(cluster)
        assert set(started) == {"munged", "mariadbd", "slurmdbd", "slurmctld", f"slurmd-{PREFIX}1"}

        again = _cluster("up", "--dir", str(root))  # no flags: keeps the running shape
        assert again.returncode == 0, again.stderr
        assert _pids(cluster) == started

        reshape = _cluster("up", "--dir", str(root), "--nodes", "2")
        assert reshape.returncode == 1 and "run `slurmrl cluster down" in reshape.stderr
        assert _pids(cluster) == started

        first_job = _submit_and_account(root)

        (root / "pids" / "stale.pid").write_text(f"{bystander.pid} 12345.0\n")
        down = _cluster("down", "--dir", str(root))
        assert down.returncode == 0, down.stderr
        assert all(not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
                   for pid in started.values())
        assert bystander.poll() is None
        assert not any((root / "pids").glob("slurm*.pid"))
        assert "no devcluster daemons were running" in _cluster("down", "--dir", str(root)).stdout

        # A reshape drops slurmctld's state but keeps the accounting: ids go on past the old job's.
        reshaped = _cluster("up", "--dir", str(root), "--nodes", "2", "--gpus-per-node", "0")
        assert reshaped.returncode == 0, reshaped.stderr
        assert _submit_and_account(root) > first_job
    finally:
        _cluster("down", "--dir", str(root))
        bystander.kill()
        bystander.wait()


def test_up_refuses_a_port_that_another_program_holds(tmp_path: Path) -> None:
    root = tmp_path / "dc"
    shape = ClusterShape(nodes=1, gpus_per_node=0, port_base=PORT_BASE)
    with socket.socket() as squatter:
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # the last test's ports may be in TIME_WAIT
        squatter.bind(("127.0.0.1", shape.slurmctld_port))
        squatter.listen()
        result = _cluster("up", "--dir", str(root), "--nodes", "1", "--gpus-per-node", "0",
                          "--port-base", str(PORT_BASE), "--node-prefix", PREFIX)
    assert result.returncode == 1
    assert f"port {shape.slurmctld_port} (for slurmctld) is in use" in result.stderr
    assert not _pids(DevCluster(root))
