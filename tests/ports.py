"""Free TCP ports for test servers on 127.0.0.1.

A port the kernel hands out for port 0 comes from its ephemeral range, which every outgoing
connection of every test process also draws from: between free_port() and the server's own bind,
another worker's HTTP client can take it (EADDRINUSE seen at -n 10). So each pytest-xdist worker
gets its own block of ports below the ephemeral range, and walks it from a random place (two
pytest sessions on one machine, each with its gw0, then rarely meet)."""

from __future__ import annotations

import itertools
import os
import random
import socket
from collections.abc import Iterator
from pathlib import Path

FIRST_PORT = 20000  # above the devcluster's daemons (17800 + a few)
PORTS_PER_WORKER = 500


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _worker_block() -> range:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    blocks = max(1, (_ephemeral_low() - FIRST_PORT) // PORTS_PER_WORKER)
    start = FIRST_PORT + (int(worker) if worker.isdigit() else 0) % blocks * PORTS_PER_WORKER
    return range(start, start + PORTS_PER_WORKER)


def _walk() -> Iterator[int]:
    block = _worker_block()
    start = random.randrange(len(block))
    return itertools.cycle([*block[start:], *block[:start]])


_candidates = _walk()


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_port() -> int:
    """A port nothing listens on now, from this worker's block (the kernel's choice where the
    machine leaves no room below its ephemeral range)."""
    if _ephemeral_low() <= FIRST_PORT + PORTS_PER_WORKER:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            return sock.getsockname()[1]
    for _ in range(PORTS_PER_WORKER):
        port = next(_candidates)
        if _bindable(port):
            return port
    raise RuntimeError(f"no free port in {_worker_block()}")
