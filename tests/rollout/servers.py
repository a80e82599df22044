"""Local CPU engines and routers as processes on 127.0.0.1, for tests and benchmarks; each is
stopped by its PID."""

from __future__ import annotations

import contextlib
import socket
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import requests

from rollout.launch import EngineLaunch, RouterLaunch, cpu_engine_command, router_command
from rollout.router_client import RouterClient
from slurm.devcluster.daemons import wait_for

API_KEY = "test-job-key"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def engine(model: Path, log: Path, deterministic: bool = False, role: str = "regular",
           bootstrap_port: int | None = None) -> Server:
    port = free_port()
    argv = cpu_engine_command(EngineLaunch(str(model), "127.0.0.1", port, api_key=API_KEY, weight_version="v1",
                                           role=role, bootstrap_port=bootstrap_port))
    argv += ["--enable-deterministic-inference"] if deterministic else []
    return start(argv, f"http://127.0.0.1:{port}", log, "/health")


@contextlib.contextmanager
def engines_behind_router(model: Path, log_dir: Path, count: int = 2,
                          deterministic: bool = False) -> Iterator[tuple[RouterClient, list[Server]]]:
    """`count` CPU engines behind a real router, all on loopback, all stopped by PID at the end
    (batch-invariant with `deterministic`: --enable-deterministic-inference)."""
    servers: list[Server] = []
    try:
        engines = [engine(model, log_dir / f"engine{i}.log", deterministic) for i in range(count)]
        servers += engines
        port = free_port()
        argv = router_command(RouterLaunch("127.0.0.1", port, free_port(), api_key=API_KEY, policy="round_robin"))
        servers.append(start(argv, f"http://127.0.0.1:{port}", log_dir / "router.log", "/liveness"))
        router = RouterClient(servers[-1].url, API_KEY, timeout_s=10)
        for server in engines:
            router.add_worker(server.url, api_key=API_KEY)
        for server in engines:
            router.wait_listed(server.url, timeout_s=60)
        yield router, engines
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
        prefills = []
        for i in range(prefill):
            bootstrap_port = free_port()
            prefills.append(engine(model, log_dir / f"prefill{i}.log", role="prefill", bootstrap_port=bootstrap_port))
            prefills[-1].bootstrap_port = bootstrap_port
        servers += prefills
        decodes = [engine(model, log_dir / f"decode{i}.log", role="decode") for i in range(decode)]
        servers += decodes
        port = free_port()
        argv = router_command(RouterLaunch("127.0.0.1", port, free_port(), api_key=API_KEY, policy="round_robin",
                                           pd_disaggregation=True))
        servers.append(start(argv, f"http://127.0.0.1:{port}", log_dir / "router.log", "/liveness"))
        router = RouterClient(servers[-1].url, API_KEY, timeout_s=10)
        for server in prefills:
            router.add_worker(server.url, api_key=API_KEY, worker_type="prefill", bootstrap_port=server.bootstrap_port)
        for server in decodes:
            router.add_worker(server.url, api_key=API_KEY, worker_type="decode")
        for server in prefills + decodes:
            router.wait_listed(server.url, timeout_s=60)
        yield router, prefills, decodes
    finally:
        for server in servers:
            server.stop()
