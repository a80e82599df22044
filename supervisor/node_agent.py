"""The node agent: one SLURM step per node (`steps.engine_launch: node_agent`) that starts, watches and
stops that node's engines as its own children, so that an engine's launch or restart is a message,
not a new step: no srun client per engine on the head node and no step against MaxStepCount. The
supervisor's side is supervisor/node_agents.py.

Its channel is the step's own standard streams, which srun carries between the supervisor and the
node (authenticated by SLURM, no port to open): one JSON object a line each way.

    supervisor -> agent   {"start": NAME, "argv": [...], "env": {...}, "log": PATH, "cwd": DIR|null, "gpus": N}
                          {"stop": NAME, "grace_s": S}    SIGTERM to its process group, SIGKILL S later
    agent -> supervisor   {"ready": NODE, "gpus": [...]}  once, first
                          {"started": NAME, "pid": PID}
                          {"exited": NAME, "code": C}     as a shell reports it (128 + N: signal N)
                          {"refused": NAME, "why": TEXT}  (could not start it: no free GPUs, no program)

Each engine runs in its own process group, and dies with the agent (Linux's parent-death signal:
an agent killed outright, by the OOM killer or a lost srun, leaves no engine holding its port and
GPUs where SLURM's process tracking does not follow orphans), with its log appended to (as srun --open-mode=append
would), on N GPUs of the step's own (CUDA_VISIBLE_DEVICES: the first N free), in the agent's
environment (the step's, as srun gave it) with the variables the supervisor sends added. When its
input ends (the supervisor is gone) or SIGTERM comes (the step is cancelled), the agent stops every
engine, then exits. Standard library only: it starts in a blink.
"""

from __future__ import annotations

import ctypes
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TextIO

DEFAULT_GRACE_S = 10.0  # SIGTERM to SIGKILL when the agent itself ends
_GPU_ENV = "CUDA_VISIBLE_DEVICES"


@dataclass
class _Child:
    proc: subprocess.Popen[bytes]
    pidfd: int
    gpus: list[str]
    kill_at: float | None = None  # stopping: SIGKILL at this time.monotonic()


@dataclass
class Agent:
    out: TextIO
    gpus: list[str]  # the step's GPUs, as CUDA_VISIBLE_DEVICES names them
    children: dict[str, _Child] = field(default_factory=dict)
    selector: selectors.BaseSelector = field(default_factory=selectors.DefaultSelector)

    def say(self, **message: Any) -> None:
        self.out.write(json.dumps(message) + "\n")
        self.out.flush()

    def free_gpus(self) -> list[str]:
        taken = {gpu for child in self.children.values() for gpu in child.gpus}
        return [gpu for gpu in self.gpus if gpu not in taken]

    def start(self, name: str, argv: list[str], env: dict[str, str], log: str, cwd: str | None, gpus: int) -> None:
        if name in self.children:
            self.say(refused=name, why="it runs already")
            return
        free = self.free_gpus()
        if gpus > len(free):
            self.say(refused=name, why=f"it needs {gpus} GPUs, {len(free)} of the step's are free")
            return
        mine = free[:gpus]
        env = {**os.environ, **env, **({_GPU_ENV: ",".join(mine)} if gpus else {})}
        try:
            with open(log, "ab") as out:
                proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                        env=env, cwd=cwd, process_group=0, preexec_fn=_die_with(os.getpid()))
        except OSError as err:
            self.say(refused=name, why=f"{argv[0]}: {err}")
            return
        pidfd = os.pidfd_open(proc.pid)
        self.children[name] = _Child(proc, pidfd, mine)
        self.selector.register(pidfd, selectors.EVENT_READ, name)
        self.say(started=name, pid=proc.pid)

    def stop(self, name: str, grace_s: float) -> None:
        child = self.children.get(name)
        if child is None or child.kill_at is not None:
            return
        _signal_group(child.proc.pid, signal.SIGTERM)
        child.kill_at = time.monotonic() + grace_s

    def reap(self, name: str) -> None:
        child = self.children.pop(name)
        self.selector.unregister(child.pidfd)
        os.close(child.pidfd)
        code = child.proc.wait()
        self.say(exited=name, code=code if code >= 0 else 128 - code)

    def kill_overdue(self) -> None:
        now = time.monotonic()
        for child in self.children.values():
            if child.kill_at is not None and now >= child.kill_at:
                _signal_group(child.proc.pid, signal.SIGKILL)
                child.kill_at = now + DEFAULT_GRACE_S  # and again, should it outlive that

    def next_deadline_s(self) -> float | None:
        due = [c.kill_at for c in self.children.values() if c.kill_at is not None]
        return max(0.0, min(due) - time.monotonic()) if due else None

    def handle(self, line: str) -> None:
        try:
            message = json.loads(line)
            if "start" in message:
                self.start(message["start"], list(message["argv"]), dict(message.get("env") or {}), message["log"],
                           message.get("cwd"), int(message.get("gpus", 0)))
            elif "stop" in message:
                self.stop(message["stop"], float(message.get("grace_s", DEFAULT_GRACE_S)))
            else:
                raise ValueError("neither start nor stop")
        except (ValueError, KeyError, TypeError) as err:  # a bad line is said, and the rest goes on
            print(f"node agent: ignored {line.strip()[:200]!r}: {err}", file=sys.stderr, flush=True)

    def stop_all_and_wait(self) -> None:
        for name in list(self.children):
            self.stop(name, DEFAULT_GRACE_S)
        while self.children:
            for key, _ in self.selector.select(self.next_deadline_s()):
                if isinstance(key.data, str):
                    self.reap(key.data)
            self.kill_overdue()


_INPUT, _ENDING = object(), object()  # selector keys' data besides children's names
_READ_BYTES = 65536


def run(stdin_fd: int, stdout: TextIO) -> int:
    visible = os.environ.get(_GPU_ENV, "")
    agent = Agent(stdout, [gpu for gpu in visible.split(",") if gpu])
    ending = os.pipe()  # SIGTERM's handler writes here, so the select loop wakes up
    signal.signal(signal.SIGTERM, lambda *_: os.write(ending[1], b"x"))
    agent.selector.register(ending[0], selectors.EVENT_READ, _ENDING)
    agent.selector.register(stdin_fd, selectors.EVENT_READ, _INPUT)
    agent.say(ready=os.environ.get("SLURMD_NODENAME") or socket.gethostname(), gpus=agent.gpus)
    pending = b""  # read from the input, not yet a whole line (raw reads: a buffered reader would
    while True:    # keep lines the selector never announces again)
        for key, _ in agent.selector.select(agent.next_deadline_s()):
            if key.data is _INPUT:
                data = os.read(stdin_fd, _READ_BYTES)
                if not data:  # the supervisor is gone: nobody would restart or stop them
                    agent.stop_all_and_wait()
                    return 0
                *lines, pending = (pending + data).split(b"\n")
                for line in lines:
                    agent.handle(line.decode())
            elif key.data is _ENDING:
                agent.stop_all_and_wait()
                return 0
            else:
                agent.reap(key.data)
        agent.kill_overdue()


_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _die_with(agent_pid: int) -> Callable[[], None]:
    """For Popen's preexec_fn (the agent has one thread, so it is safe here): the child gets SIGKILL
    when the agent dies, and ends at once if the agent died before it asked."""
    def ask() -> None:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != agent_pid:
            os._exit(128 + signal.SIGKILL)
    return ask


def _signal_group(pid: int, signum: int) -> None:
    try:
        os.killpg(pid, signum)
    except ProcessLookupError:
        pass


def main() -> None:
    sys.exit(run(sys.stdin.fileno(), sys.stdout))


if __name__ == "__main__":
    main()
