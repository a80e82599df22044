"""The control protocol: the calls the supervisor answers on JOB_DIR/control.sock, their argument
types, the wire format and the client (the trainer's and the CLI's side). The server is
supervisor/control.py. Torch-free.

Wire format: one JSON object per line each way. Request {"call": NAME, "args": {...}}, and from a
process inside a SLURM job its run, {"run": {"job_id": ID, "run": N}}; answer {"ok": true, ...the
handler's dict} or {"ok": false, "error": "..."}, with "fenced": true when the caller is of an
older run of the job than the supervisor (supervisor/fencing.py): it must stop, writing nothing.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass
from enum import Enum
from typing import Any

from contract.job_dir import JobDir

MAX_LINE = 1 << 20  # bytes: the longest request or answer
RUN_ENV = "SLURM_RESTART_COUNT"  # SLURM's restart count of the job: its run (unset before the first requeue)


class Call(str, Enum):
    STATUS = "status"                # CLI: the job's state -> {"state": {...}}
    RESTART = "restart"              # CLI: restart one step -> {"restarting": target}
    STOP = "stop"                    # CLI: save at the next rollout boundary, then end
    READY_ENGINES = "ready_engines"  # trainer: engines to get the next version -> {"engines": [url], "starting": bool}
    PUBLISHED = "published"          # trainer: a version went out (to `updated`; `dropped` failed)
    ENGINE_FAILED = "engine_failed"  # trainer: a request to an engine failed
    ENGINE_UNRESPONSIVE = "engine_unresponsive"  # trainer: requests time out or do not parse; probes may pass
    TRAINER_POLL = "trainer_poll"    # trainer, between rollouts: -> {"stop": bool, "profile": request | None}
    GPU_HOLDER = "gpu_holder"        # trainer, --colocate: who holds the shared GPUs -> {"released": [url]}
    PROFILE = "profile"              # CLI: profile rollout|train for N steps -> {"dir", "engines", "failed"}
    PLUGIN_ERROR = "plugin_error"    # trainer: a user function first failed on a sample (the rollout goes on)


# Each call's arguments and their JSON types (what a handler receives as keyword arguments).
ARGUMENTS: dict[Call, dict[str, type]] = {
    Call.STATUS: {},
    Call.RESTART: {"target": str},
    Call.STOP: {},
    Call.READY_ENGINES: {},
    Call.PUBLISHED: {"version": int, "updated": list, "dropped": dict},
    Call.ENGINE_FAILED: {"url": str, "reason": str},
    Call.ENGINE_UNRESPONSIVE: {"url": str, "reason": str},
    Call.TRAINER_POLL: {"rollout_id": int},
    Call.PROFILE: {"target": str, "steps": int},
    Call.GPU_HOLDER: {"holder": str, "released": list},
    Call.PLUGIN_ERROR: {"plugin": str, "error": str, "sample": int},
}


class ControlError(RuntimeError):
    """The supervisor could not be reached, or it refused or failed the call."""


class CallerFenced(ControlError):
    """The supervisor is of a newer run of the job than the caller (SLURM requeued it meanwhile)."""


class SupervisorUnreachable(ControlError):
    """No supervisor answered (none runs, or it died mid-call): worth asking again while its
    watchdog restarts it; a refused or failed call is not."""


@dataclass(frozen=True)
class CallerRun:
    """Which run of which SLURM job a caller belongs to."""

    job_id: str
    run: int

    @classmethod
    def here(cls) -> CallerRun | None:
        """This process's, if it runs inside a SLURM job."""
        job_id = os.environ.get("SLURM_JOB_ID")
        return cls(job_id, int(os.environ.get(RUN_ENV, "0"))) if job_id else None


def recorded_run(job_dir: JobDir, job_id: str) -> int | None:
    """The run of job_id the job dir's state store holds (the newest supervisor's); None for
    another job's state, or none yet."""
    try:
        state = json.loads(job_dir.state.read_text())
    except (OSError, ValueError):
        return None  # none yet, or being replaced (an atomic rename: a reader sees old or new)
    return int(state.get("requeues", 0)) if state.get("job_id") == job_id else None


def superseded(job_dir: JobDir) -> bool:
    """Whether this process belongs to an older run of its job than the job dir's newest (SLURM
    requeued the job without it, e.g. its node was cut off): then it must write nothing there."""
    run = CallerRun.here()
    if run is None:
        return False
    recorded = recorded_run(job_dir, run.job_id)
    return recorded is not None and recorded > run.run


@dataclass(frozen=True)
class Request:
    call: Call
    args: dict[str, Any]
    run: CallerRun | None = None

    def encode(self) -> bytes:
        raw: dict[str, Any] = {"call": self.call.value, "args": self.args}
        if self.run is not None:
            raw["run"] = {"job_id": self.run.job_id, "run": self.run.run}
        return (json.dumps(raw) + "\n").encode()

    @classmethod
    def decode(cls, line: bytes) -> Request:
        """The request of one line; ValueError naming what is wrong with it."""
        try:
            raw = json.loads(line)
            call, args = Call(raw["call"]), raw.get("args", {})
            run = CallerRun(str(raw["run"]["job_id"]), int(raw["run"]["run"])) if raw.get("run") is not None else None
        except (ValueError, KeyError, TypeError) as err:
            raise ValueError(f"bad request ({err!r}); calls: {', '.join(c.value for c in Call)}") from None
        expected = ARGUMENTS[call]
        if not isinstance(args, dict) or set(args) != set(expected):
            raise ValueError(f"{call.value} takes arguments {sorted(expected)}, got "
                             f"{sorted(args) if isinstance(args, dict) else args!r}")
        for name, kind in expected.items():
            if not isinstance(args[name], kind) or (kind is int and isinstance(args[name], bool)):
                raise ValueError(f"{call.value}: {name} must be a {kind.__name__}, got {args[name]!r}")
        return cls(call, args, run)


class ControlClient:
    """`ControlClient(job_dir, timeout_s).call(Call.STATUS)` -> the handler's answer (without "ok").
    timeout_s bounds one call: connecting, sending and waiting for the answer."""

    def __init__(self, job_dir: JobDir, timeout_s: float) -> None:
        self.job_dir = job_dir
        self.timeout_s = timeout_s

    def call(self, call: Call, **args: Any) -> dict[str, Any]:
        request = Request(Call(call), args, CallerRun.here())
        path = self.job_dir.control_socket
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout_s)
        try:
            try:
                sock.connect(str(path))
            except (FileNotFoundError, ConnectionRefusedError):
                raise SupervisorUnreachable(f"no supervisor is running for {self.job_dir.root} "
                                            f"(no {path.name})") from None
            except PermissionError:  # the socket is 0600: only the job's owner may steer it
                raise ControlError(f"permission denied: you do not own the job in {self.job_dir.root}") from None
            sock.sendall(request.encode())
            line = sock.makefile("rb").readline(MAX_LINE)
        except TimeoutError:
            raise SupervisorUnreachable(f"the supervisor of {self.job_dir.root} did not answer "
                                        f"{request.call.value!r} within {self.timeout_s:.0f} s") from None
        except (ConnectionResetError, BrokenPipeError):
            line = b""  # it died mid-call
        finally:
            sock.close()
        if not line:
            raise SupervisorUnreachable(f"the supervisor of {self.job_dir.root} closed the connection "
                                        "without answering")
        answer = json.loads(line)
        if not answer.pop("ok"):
            raise (CallerFenced if answer.get("fenced") else ControlError)(answer["error"])
        return answer
