"""The control socket: owner-only (file mode and SO_PEERCRED), one JSON line each way."""

from __future__ import annotations

import json
import os
import socket
import stat
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from supervisor.control import SOCKET_FILE, ControlClient, ControlError, ControlServer

NOBODY = 65534


@pytest.fixture
def job_dir() -> Iterator[Path]:
    # Not under pytest's tmp_path (0700 parents): uid nobody must be able to reach the socket
    # file, so that only the socket's own protections stand in its way.
    path = Path(tempfile.mkdtemp(prefix="slurmrl-control-"))
    path.chmod(0o755)
    yield path
    for child in path.iterdir():
        child.unlink()
    path.rmdir()


@pytest.fixture
def server(job_dir: Path) -> Iterator[ControlServer]:
    srv = ControlServer(job_dir)
    srv.register("status", lambda: {"engines": 3})
    srv.register("restart", lambda step: {"restarting": step})
    srv.register("broken", lambda: 1 / 0)
    old = os.umask(0)  # the socket must be 0600 whatever the process umask
    try:
        srv.start()
    finally:
        os.umask(old)
    yield srv
    srv.close()


def ask_as(uid: int, path: Path) -> dict[str, str]:
    """Fork a child that drops to `uid` and asks "status"; what it got back."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(read_fd)
            os.setuid(uid)
            with socket.socket(socket.AF_UNIX) as s:
                s.settimeout(10)
                s.connect(str(path))
                s.sendall(b'{"call": "status"}\n')
                answer = {"answer": s.makefile().readline()}
        except OSError as err:
            answer = {"error": type(err).__name__}
        os.write(write_fd, json.dumps(answer).encode())
        os._exit(0)
    os.close(write_fd)
    with os.fdopen(read_fd) as r:
        out = json.loads(r.read())
    os.waitpid(pid, 0)
    return out


def test_calls_reach_their_handlers_and_errors_come_back(server: ControlServer, job_dir: Path) -> None:
    client = ControlClient(job_dir)
    assert client.call("status") == {"engines": 3}
    assert client.call("restart", step="engine-2") == {"restarting": "engine-2"}
    with pytest.raises(ControlError, match="broken failed: ZeroDivisionError"):
        client.call("broken")
    with pytest.raises(ControlError, match="calls: broken, restart, status"):
        client.call("nope")
    with pytest.raises(ControlError, match="restart failed: TypeError"):
        client.call("restart")


def test_a_slow_handler_does_not_block_other_callers(server: ControlServer, job_dir: Path) -> None:
    release = threading.Event()
    server.register("slow", lambda: {"released": release.wait(30)})
    answers: list[dict[str, object]] = []
    slow = threading.Thread(target=lambda: answers.append(ControlClient(job_dir).call("slow")))
    slow.start()
    assert ControlClient(job_dir, timeout_s=5).call("status") == {"engines": 3}
    release.set()
    slow.join()
    assert answers == [{"released": True}]


def test_socket_is_0600_and_another_uid_cannot_connect(server: ControlServer, job_dir: Path) -> None:
    sock = job_dir / SOCKET_FILE
    assert stat.S_ISSOCK(sock.stat().st_mode)
    assert stat.S_IMODE(sock.stat().st_mode) == 0o600
    assert ask_as(NOBODY, sock) == {"error": "PermissionError"}


def test_peer_uid_is_checked_even_if_the_socket_mode_is_loosened(server: ControlServer, job_dir: Path) -> None:
    sock = job_dir / SOCKET_FILE
    sock.chmod(0o666)
    answer = json.loads(ask_as(NOBODY, sock)["answer"])
    assert answer == {"ok": False, "error": f"permission denied: uid {NOBODY} does not own this job"}
    assert ask_as(os.getuid(), sock)["answer"].startswith('{"ok": true')


def test_no_supervisor_is_a_clear_error(job_dir: Path) -> None:
    with pytest.raises(ControlError, match="no supervisor is running for .* \\(no control.sock\\)"):
        ControlClient(job_dir).call("status")


def test_a_stale_socket_is_replaced_but_a_live_one_is_not(job_dir: Path) -> None:
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(job_dir / SOCKET_FILE))
    stale.close()  # the file stays, nobody listens: a supervisor that died
    with ControlServer(job_dir) as srv:
        srv.register("status", lambda: {"fresh": True})
        assert ControlClient(job_dir).call("status") == {"fresh": True}
        with pytest.raises(ControlError, match="another supervisor already answers"):
            ControlServer(job_dir).start()
    assert not (job_dir / SOCKET_FILE).exists()
