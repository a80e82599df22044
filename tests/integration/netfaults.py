"""Network faults for tests on an isolated devcluster: run a program inside a node's network
namespace, serve TCP there, time a TCP connect from another node, and cut / slow / heal a node
(slurm/devcluster/faults.py, through the `slurmrl cluster` command people use)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil

from slurm.devcluster import netns
from slurm.devcluster.daemons import wait_for

CONNECT_TIMEOUT_S = 3.0  # a TCP connect across the bridge: a healthy one takes milliseconds
SERVER_UP_S = 15  # a python TCP server starting in a namespace
COMMAND_TIMEOUT_S = 60  # one `slurmrl cluster` fault command, or one program in a namespace
# Connect to argv[1]:argv[2] within argv[3] s; print the seconds it took, or the error's class name.
_CONNECT = ("import socket,sys,time\nt=time.monotonic()\n"
            "try: socket.create_connection((sys.argv[1],int(sys.argv[2])),timeout=float(sys.argv[3])).close()\n"
            "except OSError as e: print(type(e).__name__)\nelse: print(time.monotonic()-t)")
# Accept connections on argv[1]:argv[2] and close them, until killed.
_SERVE = ("import socket,sys\ns=socket.create_server((sys.argv[1],int(sys.argv[2])))\n"
          "while True: s.accept()[0].close()")


def in_node(root: Path, node: str) -> list[str]:
    """The argv prefix that runs a program in `node`'s network namespace (as slurmd's steps run)."""
    plan = netns.load_plan(root)
    assert plan is not None, f"no isolated devcluster at {root}"
    return plan.enter(node)


def node_addr(root: Path, node: str) -> str:
    plan = netns.load_plan(root)
    assert plan is not None, f"no isolated devcluster at {root}"
    return plan.node_addr(node)


def connect_s(root: Path, from_node: str, addr: str, port: int, timeout_s: float = CONNECT_TIMEOUT_S) -> float | None:
    """Seconds a TCP connect from `from_node` to addr:port took, or None if it failed within timeout_s."""
    out = subprocess.run([*in_node(root, from_node), sys.executable, "-c", _CONNECT, addr, str(port), str(timeout_s)],
                         capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, check=True).stdout.strip()
    try:
        return float(out)
    except ValueError:
        return None


@contextmanager
def tcp_server(root: Path, node: str, port: int) -> Iterator[psutil.Process]:
    """A TCP server on `node`'s address, up (reached from its own node) until the block ends."""
    addr = node_addr(root, node)
    proc = subprocess.Popen([*in_node(root, node), sys.executable, "-c", _SERVE, addr, str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: connect_s(root, node, addr, port) is not None or proc.poll() is not None, SERVER_UP_S,
                 f"the TCP server on {node}")
        assert proc.poll() is None, f"the TCP server on {node} exited with {proc.returncode}"
        yield psutil.Process(proc.pid)  # nsenter execs the server: this PID is the server's
    finally:
        proc.kill()
        proc.wait(timeout=COMMAND_TIMEOUT_S)


def fault(root: Path, action: str, node: str, *flags: str) -> str:
    """`slurmrl cluster ACTION NODE [flags] --dir root` (cut, slow, heal); returns what it printed."""
    done = subprocess.run([sys.executable, "-m", "slurm.devcluster", action, node, "--dir", str(root), *flags],
                          capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    assert done.returncode == 0, f"cluster {action} {node}: {done.stderr}"
    return done.stdout.strip()
