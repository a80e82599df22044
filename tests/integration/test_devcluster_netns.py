"""`slurmrl cluster up --isolated`: each node in its own network namespace. Steps on two nodes see
two addresses; a server on node2 is reached from node1 at node2's address and not through
node1's loopback; `down` leaves no namespace, link or hosts line, and no process of a step on a
node that was cut off. Uses a cluster of its own
(its own --dir and ports), brought up and down here."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from slurm.devcluster import DevCluster
from slurm.devcluster.daemons import wait_for
from slurm.devcluster.netns import HOSTS_FILE
from tests.ports import free_port

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("slurm_programs")]
PORT_BASE = 19100  # clear of the shared devcluster's (17800) and the lifecycle test's (18800)
PREFIX = f"srl-{PORT_BASE}"
NODE = "iso"  # its node names (iso1, iso2): the session's isolated cluster holds node1.. in /etc/hosts meanwhile
RECORDED_S = 30  # bound on slurmctld passing a job's record to slurmdbd
SERVER_UP_S = 30  # python's http.server starting in a step
# From a step: GET url, print the status, or the error's class and errno.
PROBE = ("import sys,urllib.request\ntry: print(urllib.request.urlopen(sys.argv[1],timeout=5).status)\n"
         "except OSError as e: print(type(e.__dict__.get('reason',e)).__name__)")


def _cluster(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "slurm.devcluster", *args], capture_output=True, text=True,
                          timeout=180)


def _srun(env: dict[str, str], node: str, *argv: str) -> str:
    return subprocess.run(["srun", "-w", node, "-N1", "-n1", *argv], env=env, capture_output=True, text=True,
                          timeout=60, check=True).stdout.strip()


def _network_leftovers() -> list[str]:
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    hosts = HOSTS_FILE.read_text()
    return [line for text in (namespaces, links, hosts) for line in text.splitlines() if PREFIX in line]


def test_isolated_nodes_have_own_addresses_and_loopback(tmp_path: Path) -> None:
    root = tmp_path / "dc"
    up = _cluster("up", "--isolated", "--dir", str(root), "--nodes", "2", "--gpus-per-node", "0",
                  "--port-base", str(PORT_BASE), "--node-prefix", NODE)
    server: subprocess.Popen[str] | None = None
    cut: int | None = None  # the server's pid once its node is cut off
    pid_file = tmp_path / "server.pid"
    try:
        if "network namespaces are not allowed here" in up.stderr:  # `up` left nothing behind (tested)
            pytest.skip(up.stderr.strip())
        assert up.returncode == 0, up.stderr
        cluster = DevCluster(root)
        assert cluster.net is not None
        env = {**os.environ, **cluster.env}
        addr1, addr2 = cluster.net.node_addr(f"{NODE}1"), cluster.net.node_addr(f"{NODE}2")
        assert _srun(env, f"{NODE}1", "hostname", "-I") == addr1
        assert _srun(env, f"{NODE}2", "hostname", "-I") == addr2
        assert addr1 != addr2
        # Node names resolve to the nodes' addresses, in a step as on the host.
        resolve = "import socket,sys;print(socket.gethostbyname(sys.argv[1]))"
        assert _srun(env, f"{NODE}1", sys.executable, "-c", resolve, f"{NODE}2") == addr2
        # Accounting answers in a step as on the host (a supervisor reads its steps' exit codes with sacct).
        job = _srun(env, f"{NODE}1", "printenv", "SLURM_JOB_ID")
        record = ["sacct", "-n", "-X", "-P", "-o", "JobID", "-j", job]
        wait_for(lambda: subprocess.run(record, env=env, capture_output=True, text=True).stdout.strip() == job,
                 RECORDED_S, "the job's accounting record")
        assert _srun(env, f"{NODE}1", *record) == job

        # A server on node2's loopback, its PID in a file: node2 reaches it, node1's 127.0.0.1 is another host.
        port = free_port()
        serve = f"import os,sys;open(sys.argv[1],'w').write(str(os.getpid()));os.execv(sys.executable,[sys.executable,'-m','http.server','{port}','--bind','127.0.0.1'])"
        server = subprocess.Popen(["srun", "-w", f"{NODE}2", "-N1", "-n1", sys.executable, "-c", serve, str(pid_file)],
                                  env=env, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{port}/"
        wait_for(lambda: _srun(env, f"{NODE}2", sys.executable, "-c", PROBE, url) == "200", SERVER_UP_S,
                 "the server in node2's step, on node2's loopback")
        assert _srun(env, f"{NODE}1", sys.executable, "-c", PROBE, url) == "ConnectionRefusedError"
        # node2 cut off with the server's step running on it: `down` still leaves none of its processes.
        assert _cluster("cut", f"{NODE}2", "--dir", str(root)).returncode == 0
        cut = int(pid_file.read_text())
    finally:
        if server is not None and cut is None:
            if pid_file.exists():
                _stop(int(pid_file.read_text()))
        down = _cluster("down", "--dir", str(root))
        if server is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                server.wait(timeout=30)
            server.kill()
            server.wait(timeout=30)
    assert down.returncode == 0, down.stderr
    assert "network namespaces" in down.stdout
    assert _network_leftovers() == []
    assert not psutil.pid_exists(cut), "the cut node's step outlived `down`"
    assert not _processes_of(cluster.paths.slurm_conf), "a step process of the cluster outlived `down`"


def _processes_of(slurm_conf: Path) -> list[int]:
    """Processes that run for the cluster at slurm_conf (SLURM puts SLURM_CONF in every step's environment)."""
    found = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if proc.pid != os.getpid() and proc.environ().get("SLURM_CONF") == str(slurm_conf):
                found.append(proc.pid)
    return found


def _stop(pid: int) -> None:
    try:
        proc = psutil.Process(pid)
        proc.terminate()
        proc.wait(timeout=10)
    except psutil.NoSuchProcess:
        pass

