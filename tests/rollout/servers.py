"""Local CPU engines and routers as processes on 127.0.0.1, for tests and benchmarks; each is
stopped by its PID."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import requests

from rollout.launch import EngineLaunch, RouterLaunch, cpu_engine_command, router_command
from rollout.router_client import RouterClient
from slurm.devcluster.daemons import wait_for
from tests.ports import free_port

API_KEY = "test-job-key"
PORT_TRIES = 3  # another test process may bind a port between free_port() and the server's own bind


@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    log: Path
    bootstrap_port: int | None = None  # a prefill engine's

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def served(self) -> int:
        return self.log.read_text().count("cpu_engine served")


def start(argv: list[str], url: str, log: Path, ready: str) -> Server:
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    server = Server(proc, url, log)

    def up() -> bool:
        assert proc.poll() is None, f"{argv[2]} exited: {log.read_text()[-2000:]}"
        try:
            return requests.get(url + ready, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=2).ok
        except requests.RequestException:
            return False

    try:
        wait_for(up, 120, f"{url}{ready}")
    except BaseException:
        server.stop()
        raise
    return server


def start_on_free_ports(command: Callable[[int, int], list[str]], log: Path, ready: str) -> tuple[Server, int]:
    """Starts `command(port, second_port)` on two free ports, again on fresh ones if it lost a
    port to a race: (the server, its second port)."""
    for attempt in range(PORT_TRIES):
        port, second = free_port(), free_port()
        try:
            return start(command(port, second), f"http://127.0.0.1:{port}", log, ready), second
        except AssertionError:
            if attempt == PORT_TRIES - 1 or "address already in use" not in log.read_text():
                raise
    raise AssertionError("unreachable")


def engine(model: Path, log: Path, deterministic: bool = False, role: str = "regular",
           flags: tuple[str, ...] = ()) -> Server:
    """A CPU engine on loopback; a prefill engine's bootstrap port is kept on the server. flags:
    the CPU engine's own (e.g. --decode-step-hold-ms)."""
    def command(port: int, bootstrap_port: int) -> list[str]:
        argv = cpu_engine_command(EngineLaunch(str(model), "127.0.0.1", port, api_key=API_KEY, weight_version=1,
                                               role=role, bootstrap_port=bootstrap_port if role == "prefill" else None))
        return argv + (["--enable-deterministic-inference"] if deterministic else []) + list(flags)

    server, bootstrap_port = start_on_free_ports(command, log, "/health")
    server.bootstrap_port = bootstrap_port if role == "prefill" else None
    return server


def router(log: Path, pd_disaggregation: bool = False) -> Server:
    """A real sglang-router on loopback with no workers yet."""
    def command(port: int, prometheus_port: int) -> list[str]:
        return router_command(RouterLaunch("127.0.0.1", port, prometheus_port, api_key=API_KEY, policy="round_robin",
                                           pd_disaggregation=pd_disaggregation))

    return start_on_free_ports(command, log, "/liveness")[0]


@contextlib.contextmanager
def engines_behind_router(model: Path, log_dir: Path, count: int = 2, deterministic: bool = False,
                          flags: tuple[str, ...] = ()) -> Iterator[tuple[RouterClient, list[Server]]]:
    """`count` CPU engines behind a real router, all on loopback, all stopped by PID at the end
    (batch-invariant with `deterministic`: --enable-deterministic-inference; `flags`: the engines' own)."""
    servers: list[Server] = []
    try:
        engines = [engine(model, log_dir / f"engine{i}.log", deterministic, flags=flags) for i in range(count)]
        servers += engines
        servers.append(router(log_dir / "router.log"))
        client = RouterClient(servers[-1].url, API_KEY, timeout_s=10)
        for server in engines:
            client.add_worker(server.url, api_key=API_KEY)
        for server in engines:
            client.wait_listed(server.url, timeout_s=60)
        yield client, engines
    finally:
        for server in servers:
            server.stop()


@contextlib.contextmanager
def pd_engines_behind_router(model: Path, log_dir: Path, prefill: int = 1,
                             decode: int = 2) -> Iterator[tuple[RouterClient, list[Server], list[Server]]]:
    """Prefill and decode CPU engines behind a real router in PD mode, all on loopback, all
    stopped by PID at the end: (router, prefill engines, decode engines)."""
    servers: list[Server] = []
    try:
        prefills = [engine(model, log_dir / f"prefill{i}.log", role="prefill") for i in range(prefill)]
        servers += prefills
        decodes = [engine(model, log_dir / f"decode{i}.log", role="decode") for i in range(decode)]
        servers += decodes
        servers.append(router(log_dir / "router.log", pd_disaggregation=True))
        client = RouterClient(servers[-1].url, API_KEY, timeout_s=10)
        for server in prefills:
            client.add_worker(server.url, api_key=API_KEY, worker_type="prefill", bootstrap_port=server.bootstrap_port)
        for server in decodes:
            client.add_worker(server.url, api_key=API_KEY, worker_type="decode")
        for server in prefills + decodes:
            client.wait_listed(server.url, timeout_s=60)
        yield client, prefills, decodes
    finally:
        for server in servers:
            server.stop()
