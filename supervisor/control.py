"""The control API's server: a unix socket in the job dir that only the job's owner can use
(invariant 6). The calls, their arguments and the client are contract/control_protocol.py.

Two locks on the door: the socket file is 0600 from the moment it exists, and every connection's
peer uid is checked with SO_PEERCRED (a file mode can be loosened; the kernel's peer credentials
cannot be forged).
"""

from __future__ import annotations

import json
import os
import socket
import socketserver
import struct
import threading
from collections.abc import Callable, Mapping
from typing import Any, Self

from contract.control_protocol import MAX_LINE, Call, CallerRun, ControlError, Request
from contract.job_dir import JobDir

Handler = Callable[..., dict[str, Any]]


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
        while line := self.rfile.readline(MAX_LINE):
            if uid != self.server.owner_uid:
                _send(self.wfile, {"ok": False, "error": f"permission denied: uid {uid} does not own this job"})
                return
            _send(self.wfile, self.server.dispatch(line))


class _Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True  # a client that never hangs up must not keep the supervisor alive

    def __init__(self, path: str, handlers: Mapping[Call, Handler], run: CallerRun | None) -> None:
        self.owner_uid = os.getuid()
        self.handlers = handlers
        self.run = run
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
            request = Request.decode(line)
        except ValueError as err:
            return {"ok": False, "error": str(err)}
        if request.run is not None and self.run is not None and _older(request.run, self.run):
            # A trainer of a run SLURM requeued away (its node was cut off, then healed) must not steer this one.
            return {"ok": False, "fenced": True, "error": f"fenced: the caller is of run {request.run.run} of job "
                                                         f"{request.run.job_id}, this supervisor of run {self.run.run}"}
        try:
            return {"ok": True, **self.handlers[request.call](**request.args)}
        except Exception as err:  # noqa: BLE001 - the client gets the error; the supervisor lives on
            return {"ok": False, "error": f"{request.call.value} failed: {type(err).__name__}: {err}"}


def _older(caller: CallerRun, own: CallerRun) -> bool:
    return caller.job_id == own.job_id and caller.run < own.run


class ControlServer:
    """Serves a handler per call on JOB_DIR/control.sock from a background thread. `handler(**args)`
    returns a JSON-serialisable dict; it runs in the connection's thread. Every call of the protocol
    has a handler: a table, not a lookup by name."""

    def __init__(self, job_dir: JobDir, handlers: Mapping[Call, Handler], run: CallerRun | None = None) -> None:
        """run: this supervisor's run of its job; callers of an older run are refused as fenced."""
        missing = set(Call) - set(handlers)
        if missing:
            raise ValueError(f"no handler for {sorted(c.value for c in missing)}")
        self.path = job_dir.control_socket
        self.run = run
        self._handlers = dict(handlers)
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self._inode: int | None = None  # of the socket file this server bound

    def start(self, take_over: bool = False) -> None:
        """take_over: the socket of a supervisor still answering is replaced, not refused (it is of
        an older run of the job: fenced, see supervisor/fencing.py)."""
        if take_over:
            self.path.unlink(missing_ok=True)
        self._remove_stale_socket()
        self._server = _Server(str(self.path), self._handlers, self.run)
        self._server.server_bind()
        self._inode = self.path.stat().st_ino
        self._server.server_activate()
        self._thread = threading.Thread(target=self._server.serve_forever, name="control", daemon=True)
        self._thread.start()

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
            try:
                if self.path.stat().st_ino == self._inode:  # not a newer run's socket, bound in its place
                    self.path.unlink()
            except FileNotFoundError:
                pass

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
