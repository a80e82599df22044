"""The control socket: owner-only (file mode and SO_PEERCRED), one JSON line each way, every call
of the protocol with its handler and its arguments checked before the handler runs."""

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

from contract.job_dir import JobDir
from contract.control_protocol import Call, ControlClient, ControlError
from supervisor.control import ControlServer
from tests.control_helpers import handler_table

NOBODY = 65534


@pytest.fixture
def job_dir() -> Iterator[JobDir]:
    # Not under pytest's tmp_path (0700 parents): uid nobody must be able to reach the socket
    # file, so that only the socket's own protections stand in its way.
    path = Path(tempfile.mkdtemp(prefix="slurmrl-control-"))
    path.chmod(0o755)
    yield JobDir(path)
    for child in path.iterdir():
        child.unlink()
    path.rmdir()


RELEASE = threading.Event()  # lets a slow ready_engines call answer


@pytest.fixture
def server(job_dir: JobDir) -> Iterator[ControlServer]:
    srv = ControlServer(job_dir, handler_table({
        Call.STATUS: lambda: {"engines": 3},
        Call.RESTART: lambda target: {"restarting": target},
        Call.STOP: lambda: 1 / 0,
        Call.READY_ENGINES: lambda: {"released": RELEASE.wait(30)},
    }))
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


def raw_call(job_dir: JobDir, line: bytes) -> dict[str, object]:
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(10)
        s.connect(str(job_dir.control_socket))
        s.sendall(line)
        return json.loads(s.makefile().readline())


def test_calls_reach_their_handlers_and_errors_come_back(server: ControlServer, job_dir: JobDir) -> None:
    client = ControlClient(job_dir, timeout_s=10)
    assert client.call(Call.STATUS) == {"engines": 3}
    assert client.call(Call.RESTART, target="engine-2") == {"restarting": "engine-2"}
    with pytest.raises(ControlError, match="stop failed: ZeroDivisionError"):
        client.call(Call.STOP)
    with pytest.raises(ControlError, match=r"restart takes arguments \['target'\], got \[\]"):
        client.call(Call.RESTART)
    with pytest.raises(ControlError, match="restart: target must be a str, got 3"):
        client.call(Call.RESTART, target=3)
    unknown = raw_call(job_dir, b'{"call": "nope"}\n')
    assert unknown["ok"] is False and "calls: status, restart, stop" in str(unknown["error"])
    assert raw_call(job_dir, b'{"call": "status", "args": {}}\n') == {"ok": True, "engines": 3}


def test_a_table_missing_a_call_is_refused(job_dir: JobDir) -> None:
    with pytest.raises(ValueError, match="no handler for \\['stop'\\]"):
        ControlServer(job_dir, {call: (lambda: {}) for call in Call if call != Call.STOP})


def test_a_slow_handler_does_not_block_other_callers(server: ControlServer, job_dir: JobDir) -> None:
    RELEASE.clear()
    answers: list[dict[str, object]] = []
    slow = threading.Thread(target=lambda: answers.append(ControlClient(job_dir, 30).call(Call.READY_ENGINES)))
    slow.start()
    assert ControlClient(job_dir, timeout_s=5).call(Call.STATUS) == {"engines": 3}
    RELEASE.set()
    slow.join()
    assert answers == [{"released": True}]


def test_socket_is_0600_and_another_uid_cannot_connect(server: ControlServer, job_dir: JobDir) -> None:
    sock = job_dir.control_socket
    assert stat.S_ISSOCK(sock.stat().st_mode)
    assert stat.S_IMODE(sock.stat().st_mode) == 0o600
    assert ask_as(NOBODY, sock) == {"error": "PermissionError"}


def test_another_uids_cli_is_told_it_does_not_own_the_job(server: ControlServer, job_dir: JobDir) -> None:
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child, as nobody: what the CLI's client raises
        try:
            os.close(read_fd)
            os.setuid(NOBODY)
            ControlClient(job_dir, timeout_s=10).call(Call.STOP)
            said = "not refused"
        except Exception as err:  # noqa: BLE001 - the test reports whatever came out
            said = f"{type(err).__name__}: {err}"
        os.write(write_fd, said.encode())
        os._exit(0)
    os.close(write_fd)
    with os.fdopen(read_fd) as r:
        said = r.read()
    os.waitpid(pid, 0)
    assert said == f"ControlError: permission denied: you do not own the job in {job_dir.root}"


def test_peer_uid_is_checked_even_if_the_socket_mode_is_loosened(server: ControlServer, job_dir: JobDir) -> None:
    sock = job_dir.control_socket
    sock.chmod(0o666)
    answer = json.loads(ask_as(NOBODY, sock)["answer"])
    assert answer == {"ok": False, "error": f"permission denied: uid {NOBODY} does not own this job"}
    assert ask_as(os.getuid(), sock)["answer"].startswith('{"ok": true')


def test_no_supervisor_is_a_clear_error(job_dir: JobDir) -> None:
    with pytest.raises(ControlError, match="no supervisor is running for .* \\(no control.sock\\)"):
        ControlClient(job_dir, timeout_s=10).call(Call.STATUS)


def test_a_stale_socket_is_replaced_but_a_live_one_is_not(job_dir: JobDir) -> None:
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(job_dir.control_socket))
    stale.close()  # the file stays, nobody listens: a supervisor that died
    table = handler_table({Call.STATUS: lambda: {"fresh": True}})
    with ControlServer(job_dir, table):
        assert ControlClient(job_dir, timeout_s=10).call(Call.STATUS) == {"fresh": True}
        with pytest.raises(ControlError, match="another supervisor already answers"):
            ControlServer(job_dir, table).start()
    assert not job_dir.control_socket.exists()
