"""SLURM step control: launch steps into the job with srun, learn their step ids, notice exits,
cancel them, and adopt the ones a previous supervisor left running.

An adopted step has no srun child of ours. It gets a stand-in child instead, which exits with the
step's exit code (from SLURM's accounting) once squeue no longer lists the step: so its end
reaches on_exit, with its code, exactly like a launched step's.

Each step's srun is a child of the supervisor in its own process group, so its exit is seen the
moment it happens (one pidfd watcher thread for all steps). SLURM is asked about all steps in one
squeue call per cycle, never one per step; a failed or slow query answers "unknown", never "dead",
so a slurmctld that stops answering for a while is ridden out.

Seen on slurm 22.05: steps of het group K are listed and cancelled under that component's own
job id (hetjob 110 -> group 1 is job 111: steps "111.3"; "110+1.3" is refused by scancel), and
step numbers count up across all components of the hetjob.
"""

from __future__ import annotations

import logging
import os
import re
import select
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from supervisor.fencing import Fence
from supervisor.slurm_contact import SlurmContact, slurm_answered

log = logging.getLogger(__name__)
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
_SLURM_OWN_STEPS = ("batch", "extern")

StepStatus = Literal["pending", "running", "exited", "unknown"]

# The stand-in: exits with the code written to its stdin (or 255 when its supervisor dies first).
_STAND_IN = ("/bin/sh", "-c", 'read -r code; exit "${code:-255}"')
UNKNOWN_EXIT = 255  # accounting never recorded the step's end (no slurmdbd, or past exit_code_wait_s)
CANCELLED_EXIT = 128 + signal.SIGTERM
_ACCOUNTING_POLL_S = 1.0  # between two asks to sacct for an ended step's exit code
_GONE_POLL_S = 0.5  # between two looks whether SLURM still lists a cancelled step
_UNFINISHED = {"PENDING", "RUNNING", "SUSPENDED", "COMPLETING", "REQUEUED", "RESIZING"}


@dataclass(frozen=True)
class StepSpec:
    """What to run as one step, and where."""

    name: str  # srun --job-name; unique among the job's live steps (engine-3, router, trainer)
    argv: tuple[str, ...]
    nodes: tuple[str, ...]
    log: Path
    het_group: int | None = None  # None for a job that is not heterogeneous
    ntasks: int = 1
    gpus_per_node: int = 0
    cpus_per_task: int | None = None
    overlap: bool = False  # share CPUs/GPUs already held by other steps (e.g. --colocate)
    workdir: str | None = None  # srun --chdir; default: the supervisor's
    env: Mapping[str, str] | None = None  # the step's whole environment; default: ours
    options: tuple[str, ...] = ()  # more srun options: Pyxis's and the role's own (contract/step_options.py)

    def __post_init__(self) -> None:
        if not _NAME.fullmatch(self.name) or self.name in _SLURM_OWN_STEPS:
            raise ValueError(f"step name {self.name!r}: use letters, digits, '_', '.', '-'; not batch/extern")
        if not self.nodes or not self.argv:
            raise ValueError(f"step {self.name!r} needs nodes and a command")


def srun_argv(job_id: str, spec: StepSpec) -> list[str]:
    argv = ["srun", f"--jobid={job_id}"]
    if spec.het_group is not None:
        argv.append(f"--het-group={spec.het_group}")
    argv += [f"--nodelist={','.join(spec.nodes)}", f"--nodes={len(spec.nodes)}", f"--ntasks={spec.ntasks}",
             # Without --exact a step takes every CPU its job holds on the node and the next
             # step waits ("Requested nodes are busy"); without a GPU count it takes every GPU.
             "--exact",
             f"--gpus-per-node={spec.gpus_per_node}" if spec.gpus_per_node else "--gres=none"]
    if spec.cpus_per_task is not None:
        argv.append(f"--cpus-per-task={spec.cpus_per_task}")
    if spec.overlap:
        argv.append("--overlap")
    if spec.workdir:
        argv.append(f"--chdir={spec.workdir}")
    # Append: a relaunched step keeps its predecessor's last words in the same log.
    argv += [f"--job-name={spec.name}", f"--output={spec.log}", "--open-mode=append",
             "--kill-on-bad-exit=1", *spec.options, *spec.argv]
    return argv


@dataclass
class Step:
    """A step this supervisor launched (proc is its srun) or adopted (proc is its stand-in)."""

    spec_name: str
    proc: subprocess.Popen[bytes] | None
    slurm_step: str | None = None  # "JOBID.STEPID", once squeue lists it
    adopted: bool = False
    gone_since: float | None = None  # adopted: when squeue stopped listing it

    @property
    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()


class _ExitWatcher:
    """One thread that waits on a pidfd per srun child and reports each exit at once."""

    def __init__(self, on_exit: Callable[[Step], None]) -> None:
        self._on_exit = on_exit
        self._epoll = select.epoll()
        self._wake = os.eventfd(0)
        self._epoll.register(self._wake, select.EPOLLIN)
        self._steps: dict[int, Step] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="step-exits", daemon=True)
        self._thread.start()

    def watch(self, step: Step) -> None:
        assert step.proc is not None
        fd = os.pidfd_open(step.proc.pid)
        with self._lock:
            self._steps[fd] = step
        self._epoll.register(fd, select.EPOLLIN)

    def _run(self) -> None:
        while not self._closed:
            for fd, _ in self._epoll.poll():
                if fd == self._wake:
                    continue
                self._epoll.unregister(fd)
                os.close(fd)
                with self._lock:
                    step = self._steps.pop(fd)
                step.proc.wait()  # reap it; returncode is then set
                try:
                    self._on_exit(step)
                except Exception:  # one bad callback must not end exit detection for all steps
                    log.exception("on_exit callback failed for step %s", step.spec_name)

    def close(self) -> None:
        self._closed = True
        os.eventfd_write(self._wake, 1)
        self._thread.join()
        with self._lock:
            for fd in self._steps:
                os.close(fd)
            self._steps.clear()
        self._epoll.close()
        os.close(self._wake)


class StepController:
    """Launches, finds, cancels and adopts the steps of one SLURM job."""

    def __init__(self, job_id: str, query_timeout_s: float, exit_code_wait_s: float,
                 on_exit: Callable[[Step], None] | None = None, fence: Fence | None = None) -> None:
        """query_timeout_s: one squeue/sacct/scancel call; exit_code_wait_s: for slurmdbd to record
        the end of a step that squeue no longer lists; fence: a supervisor of an older run of the
        job launches and cancels nothing (Fenced), its step ids may be the newer run's."""
        self.job_id = job_id
        self.fence = fence
        self.query_timeout_s = query_timeout_s
        self.exit_code_wait_s = exit_code_wait_s
        self._component_ids: list[str] | None = None
        self._claimed: set[str] = set()  # step ids already tied to a Step object
        self._watcher = _ExitWatcher(on_exit) if on_exit is not None else None
        self.contact = SlurmContact()  # whether SLURM answered of late (squeue, scancel)

    def launch(self, spec: StepSpec) -> Step:
        if self.fence is not None:
            self.fence.check()
        spec.log.parent.mkdir(parents=True, exist_ok=True)
        with open(spec.log, "ab") as log:  # srun's own messages ("task 0: Killed") go there too
            proc = subprocess.Popen(srun_argv(self.job_id, spec), stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT, env=dict(spec.env) if spec.env is not None else None,
                                    process_group=0)
        step = Step(spec.name, proc)
        if self._watcher is not None:
            self._watcher.watch(step)
        return step

    def query(self) -> dict[str, tuple[str, str]] | None:
        """All live steps of the job in one squeue call: {step id: (name, state)}; None if SLURM
        did not answer (unknown, not gone)."""
        ids = self._components()
        if ids is None:
            return None
        out = self._squeue("-s", "-j", ",".join(ids), "-O", "StepId:|,StepName:|,StepState:|")
        if out is None:
            return None
        rows = {}
        for line in out.splitlines():
            step_id, name, state = line.split("|")[:3]
            if name not in _SLURM_OWN_STEPS:
                rows[step_id] = (name, state)
        return rows

    def refresh(self, steps: Iterable[Step]) -> dict[str, StepStatus]:
        """One batched query for all `steps`: fills in step ids and says where each stands; adopted
        steps that ended get their exit code (one sacct call for all of them)."""
        steps = list(steps)
        rows = self.query()
        status: dict[str, StepStatus] = {}
        ended: list[Step] = []
        for step in steps:
            if step.returncode is not None:
                status[step.spec_name] = "exited"
            elif rows is None:
                status[step.spec_name] = "unknown"
            else:
                if step.slurm_step is None:
                    step.slurm_step = self._claim(step.spec_name, rows)
                if step.slurm_step is not None and step.slurm_step in rows:
                    status[step.spec_name] = "running"
                elif step.slurm_step is not None:
                    status[step.spec_name] = "exited"  # listed before (or adopted) and now gone
                    if step.adopted:
                        ended.append(step)
                else:
                    status[step.spec_name] = "pending"  # srun still waits for resources
        self._settle(ended)
        return status

    def adopt(self, recorded: Mapping[str, str | None]) -> list[Step] | None:
        """{name: "JOBID.STEPID" or None} from the state store -> the steps of those names SLURM
        still runs: the recorded one, else the newest of that name (a predecessor that died just
        after a launch had not recorded its id yet); each with a stand-in child. None if SLURM did
        not answer (then launch nothing: a duplicate engine is worse than a late one)."""
        rows = self.query()
        if rows is None:
            return None
        alive = []
        for name, step_id in recorded.items():
            if step_id is not None and rows.get(step_id, ("", ""))[0] == name and step_id not in self._claimed:
                self._claimed.add(step_id)
            else:
                step_id = self._claim(name, rows)
            if step_id is not None:
                alive.append(self._adopted(name, step_id))
        return alive

    def ended(self, name: str, step_id: str) -> Step:
        """A step that ended while no supervisor watched it, as an adopted Step whose stand-in exits
        at once with the step's exit code (UNKNOWN_EXIT if accounting has none within exit_code_wait_s)."""
        deadline = time.monotonic() + self.exit_code_wait_s
        while (code := self.exit_codes([step_id]).get(step_id)) is None and time.monotonic() < deadline:
            time.sleep(_ACCOUNTING_POLL_S)
        step = self._adopted(name, step_id)
        _release(step, UNKNOWN_EXIT if code is None else code)
        return step

    def exit_codes(self, step_ids: Collection[str]) -> dict[str, int]:
        """{step id: exit code} of the given steps that ended, from SLURM's accounting in one sacct
        call (128 + N for a step killed by signal N). A step whose end is not recorded is left out."""
        try:
            out = subprocess.run(["sacct", "-n", "-P", "-j", ",".join(step_ids), "-o", "JobIDRaw,State,ExitCode"],
                                 capture_output=True, text=True, timeout=self.query_timeout_s, check=False)
        except subprocess.TimeoutExpired:
            return {}
        codes = {}
        for line in out.stdout.splitlines() if out.returncode == 0 else []:
            step_id, state, exit_code = line.split("|")[:3]
            if step_id in step_ids and state.split()[0] not in _UNFINISHED:
                codes[step_id] = _exit_code(state.split()[0], exit_code)
        return codes

    def cancel(self, step: Step, timeout_s: float, term_grace_s: float) -> None:
        """scancel the step (never --full: the batch step is the supervisor), then wait for its
        srun with a deadline, then SIGTERM and SIGKILL srun's own process group. An adopted step:
        wait until SLURM no longer lists it, then let its stand-in exit."""
        if self.fence is not None:
            self.fence.check()  # srun's SIGTERM below cancels by step id too
        if step.slurm_step is not None:
            try:
                done = subprocess.run(["scancel", step.slurm_step], capture_output=True,
                                      timeout=self.query_timeout_s, check=False)
            except subprocess.TimeoutExpired:
                self.contact.record(answered=False)
                raise
            self.contact.record(slurm_answered(done.returncode, done.stderr))
        if step.adopted:
            self._wait_gone(step, timeout_s)
            self._claimed.discard(step.slurm_step)  # free: a requeued component numbers its steps from 0 again
            _release(step, CANCELLED_EXIT)
            step.proc.wait(term_grace_s)
            return
        try:
            step.proc.wait(timeout_s)
            return
        except subprocess.TimeoutExpired:
            pass
        # A step SLURM never started (still pending) or a slurmctld that does not answer:
        # srun itself cancels its step on SIGTERM.
        for sig, wait_s in ((signal.SIGTERM, term_grace_s), (signal.SIGKILL, term_grace_s)):
            try:
                os.killpg(step.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                step.proc.wait(wait_s)
                return
            except subprocess.TimeoutExpired:
                continue
        step.proc.wait(0)  # raises TimeoutExpired if even SIGKILL did not end it

    def abandon(self, step: Step, wait_s: float) -> None:
        """A fenced supervisor's step: SIGKILL its srun (or stand-in), which sends SLURM nothing
        more (a SIGTERM would have srun cancel the step by its id: the newer run's step now)."""
        if step.proc is None or step.proc.poll() is not None:
            return
        try:
            os.killpg(step.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        step.proc.wait(wait_s)

    def close(self) -> None:
        if self._watcher is not None:
            self._watcher.close()

    def _wait_gone(self, step: Step, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            rows = self.query()
            if rows is not None and step.slurm_step not in rows:
                return
            time.sleep(_GONE_POLL_S)
        raise TimeoutError(f"step {step.slurm_step} ({step.spec_name}) still runs {timeout_s:.0f} s after scancel")

    def _adopted(self, name: str, step_id: str) -> Step:
        stand_in = subprocess.Popen(_STAND_IN, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL, process_group=0)
        step = Step(name, stand_in, step_id, adopted=True)
        if self._watcher is not None:
            self._watcher.watch(step)
        return step

    def _settle(self, ended: list[Step]) -> None:
        """Release the stand-ins of adopted steps that ended, once their exit codes are known."""
        if not ended:
            return
        codes = self.exit_codes([step.slurm_step for step in ended])
        now = time.monotonic()
        for step in ended:
            step.gone_since = step.gone_since or now
            code = codes.get(step.slurm_step)
            if code is not None or now - step.gone_since > self.exit_code_wait_s:
                _release(step, UNKNOWN_EXIT if code is None else code)

    def _claim(self, name: str, rows: Mapping[str, tuple[str, str]]) -> str | None:
        # Step numbers only grow within a job, so the newest unclaimed step of that name is the
        # one just launched; older ones (a predecessor still completing) are already claimed.
        fresh = [sid for sid, (n, _) in rows.items() if n == name and sid not in self._claimed]
        if not fresh:
            return None
        newest = max(fresh, key=lambda sid: int(sid.rsplit(".", 1)[1]))
        self._claimed.add(newest)
        return newest

    def _components(self) -> list[str] | None:
        # A hetjob's group K is its own job id (leader + offset) and squeue lists that group's
        # steps only under it; learn the ids once.
        if self._component_ids is None:
            out = self._squeue("-j", self.job_id, "-o", "%A")
            if out is None:
                return None
            self._component_ids = sorted(set(out.split()), key=int) or [self.job_id]
        return self._component_ids

    def _squeue(self, *args: str) -> str | None:
        try:
            result = subprocess.run(["squeue", "-h", *args], capture_output=True, text=True,
                                    timeout=self.query_timeout_s, check=False)
        except subprocess.TimeoutExpired:
            self.contact.record(answered=False)
            return None
        self.contact.record(slurm_answered(result.returncode, result.stderr))
        return result.stdout if result.returncode == 0 else None


def _exit_code(state: str, exit_code: str) -> int:
    """sacct's State and ExitCode ("CODE:SIGNAL") as a shell would report the step's end."""
    code, _, signum = exit_code.partition(":")
    value = 128 + int(signum) if int(signum or 0) else int(code)
    # A step that did not complete (cancelled, node failure, time limit) can show 0:0: not a success.
    return UNKNOWN_EXIT if value == 0 and state != "COMPLETED" else value


_release_lock = threading.Lock()


def _release(step: Step, code: int) -> None:
    """Let an adopted step's stand-in exit with `code` (once: later calls do nothing)."""
    with _release_lock:
        stdin = step.proc.stdin
        if stdin is None or stdin.closed:
            return
        try:
            os.write(stdin.fileno(), f"{code}\n".encode())
        except BrokenPipeError:  # it is gone already
            pass
        stdin.close()
