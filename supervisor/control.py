"""The control API: a unix socket in the job dir that only the job's owner can use (invariant 6).

Two locks on the door: the socket file is 0600 from the moment it exists, and every connection's
peer uid is checked with SO_PEERCRED (a file mode can be loosened; the kernel's peer credentials
cannot be forged). Protocol: one JSON object per line each way. Request {"call": NAME,
"args": {...}}; answer {"ok": true, ...the handler's dict} or {"ok": false, "error": "..."}.
"""

from __future__ import annotations

import json
import os
import socket
import socketserver
import struct
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, Self

SOCKET_FILE = "control.sock"
_MAX_LINE = 1 << 20

Handler = Callable[..., dict[str, Any]]


class ControlError(RuntimeError):
    """The supervisor could not be reached, or it refused or failed the call."""


class SupervisorUnreachable(ControlError):
    """No supervisor answered (none runs, or it died mid-call): worth asking again while its
    watchdog restarts it; a refused or failed call is not."""


def peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end of a connected unix socket."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return uid


def _send(wfile: Any, answer: dict[str, Any]) -> None:
    wfile.write((json.dumps(answer) + "\n").encode())
    wfile.flush()


class _Connection(socketserver.StreamRequestHandler):
    server: _Server

    def handle(self) -> None:
        uid = peer_uid(self.request)
        # Read the request before refusing, so the client's send never races our close.
        while line := self.rfile.readline(_MAX_LINE):
            if uid != self.server.owner_uid:
                _send(self.wfile, {"ok": False, "error": f"permission denied: uid {uid} does not own this job"})
                return
            _send(self.wfile, self.server.dispatch(line))


class _Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True  # a client that never hangs up must not keep the supervisor alive

    def __init__(self, path: str, handlers: dict[str, Handler]) -> None:
        self.owner_uid = os.getuid()
        self.handlers = handlers
        super().__init__(path, _Connection, bind_and_activate=False)

    def server_bind(self) -> None:
        # umask is process-wide: this brief window only narrows what other threads create.
        old = os.umask(0o177)
        try:
            super().server_bind()
        finally:
            os.umask(old)

    def dispatch(self, line: bytes) -> dict[str, Any]:
        try:
            request = json.loads(line)
            name, args = request["call"], request.get("args", {})
            handler = self.handlers[name]
        except (ValueError, KeyError, TypeError) as err:
            known = ", ".join(sorted(self.handlers))
            return {"ok": False, "error": f"bad request ({err!r}); calls: {known}"}
        try:
            return {"ok": True, **handler(**args)}
        except Exception as err:  # noqa: BLE001 - the client gets the error; the supervisor lives on
            return {"ok": False, "error": f"{name} failed: {type(err).__name__}: {err}"}


class ControlServer:
    """Serves registered handlers on JOB_DIR/control.sock from a background thread."""

    def __init__(self, job_dir: Path) -> None:
        self.path = Path(job_dir) / SOCKET_FILE
        self._handlers: dict[str, Handler] = {}
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    def register(self, name: str, handler: Handler) -> None:
        """`handler(**args)` returns a JSON-serialisable dict; it runs in the connection's thread."""
        self._handlers[name] = handler

    def start(self) -> None:
        self._remove_stale_socket()
        self._server = _Server(str(self.path), self._handlers)
        self._server.server_bind()
        self._server.server_activate()
        self._thread = threading.Thread(target=self._server.serve_forever, name="control", daemon=True)
        self._thread.start()

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self.path.unlink(missing_ok=True)
            self._server = None

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _remove_stale_socket(self) -> None:
        """A socket left by a supervisor that died (then requeued) is removed; a live one is not."""
        if not self.path.exists():
            return
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(self.path))
        except ConnectionRefusedError:
            self.path.unlink()
            return
        finally:
            probe.close()
        raise ControlError(f"another supervisor already answers on {self.path}")


class ControlClient:
    """`ControlClient(job_dir).call("status")` -> the handler's answer (without "ok")."""

    def __init__(self, job_dir: Path, timeout_s: float = 30.0) -> None:
        self.job_dir = Path(job_dir)
        self.path = self.job_dir / SOCKET_FILE
        self.timeout_s = timeout_s

    def call(self, name: str, **args: Any) -> dict[str, Any]:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout_s)
        try:
            try:
                sock.connect(str(self.path))
            except (FileNotFoundError, ConnectionRefusedError):
                raise SupervisorUnreachable(f"no supervisor is running for {self.job_dir} (no {SOCKET_FILE})") from None
            sock.sendall((json.dumps({"call": name, "args": args}) + "\n").encode())
            line = sock.makefile("rb").readline(_MAX_LINE)
        except TimeoutError:
            raise SupervisorUnreachable(f"the supervisor of {self.job_dir} did not answer {name!r} "
                                        f"within {self.timeout_s:.0f} s") from None
        except (ConnectionResetError, BrokenPipeError):
            line = b""  # it died mid-call
        finally:
            sock.close()
        if not line:
            raise SupervisorUnreachable(f"the supervisor of {self.job_dir} closed the connection without answering")
        answer = json.loads(line)
        if not answer.pop("ok"):
            raise ControlError(answer["error"])
        return answer
