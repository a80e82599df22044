"""The local backend of step control (supervisor/step_control.py): each step is a plain process on
this machine, in its own process group, known by its PID; no SLURM. The supervisor's recovery,
adoption and node logic run against it in seconds, in tests, with the same calls as against
StepController (submitit's local executor beside its SLURM one is the model).

What SLURM keeps for a job, a registry folder keeps here: one JSON file per step ("JOB.N", numbers
only growing, as SLURM's step ids do) with its name, PID and the PID's start time (a reused PID is
not the step), and its exit code once the supervisor that launched it saw it end (SLURM's
accounting). So a second LocalSteps over the same folder (a restarted supervisor) lists, adopts
and cancels the first one's steps as StepController does SLURM's. A step's node names are not
used: every step runs here.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from pathlib import Path
from typing import Any

import psutil

from contract.job_dir import write_atomic
from slurm.contact import SlurmContact
from slurm.pacing import rate_limited
from slurm.step_spec import StepSpec
from supervisor.fencing import Fence
from supervisor.step_control import (
    CANCELLED_EXIT,
    UNKNOWN_EXIT,
    ExitWatcher,
    Step,
    StepCount,
    StepStatus,
    kill_process_group,
    log_offset,
    release,
    srun_lines,
    stand_in,
    stop_process_group,
)

_GONE_POLL_S = 0.1  # between two looks whether an adopted step's process has ended


class LocalSteps:
    """Launches, finds, cancels and adopts the steps of one job as processes on this machine."""

    def __init__(self, job_id: str, registry: Path, on_exit: Callable[[Step], None] | None = None,
                 fence: Fence | None = None) -> None:
        """registry: the folder that records the job's steps (shared by the supervisors of the job)."""
        self.job_id = job_id
        self.fence = fence
        self.registry = registry
        registry.mkdir(parents=True, exist_ok=True)
        self.answering = True  # False: act as a silent scheduler (query answers None), for outage tests
        self._contact = SlurmContact()
        self._lock = threading.Lock()
        self._claimed: set[str] = set()
        self._on_exit = on_exit
        self._watcher = ExitWatcher(self._exited) if on_exit is not None else None

    @property
    def contact(self) -> SlurmContact:
        return self._contact

    # ------------------------------------------------------------------ the interface
    def launch(self, spec: StepSpec) -> Step:
        step = self._start(spec, piped=False)
        if self._watcher is not None:
            self._watcher.watch(step)
        return step

    def launch_piped(self, spec: StepSpec) -> Step:
        """As StepController's: its stdin and stdout are pipes to us, its stderr goes to its log."""
        return self._start(spec, piped=True)

    def _start(self, spec: StepSpec, piped: bool) -> Step:
        """The step's process in its own process group, recorded as a step of the job; its output to
        its log, or (piped) its stdin and stdout to us and only its stderr to the log."""
        if self.fence is not None:
            self.fence.check()
        spec.log.parent.mkdir(parents=True, exist_ok=True)
        offset = log_offset(spec.log)
        with open(spec.log, "ab") as log:
            proc = subprocess.Popen(list(spec.argv), stdin=subprocess.PIPE if piped else subprocess.DEVNULL,
                                    stdout=subprocess.PIPE if piped else log,
                                    stderr=log if piped else subprocess.STDOUT,
                                    env=dict(spec.env) if spec.env is not None else None, cwd=spec.workdir,
                                    process_group=0)
        with self._lock:
            step_id = f"{self.job_id}.{self._next_number()}"
            self._write(step_id, {"name": spec.name, "pid": proc.pid, "started": _start_time(proc.pid)})
            self._claimed.add(step_id)
        return Step(spec.name, proc, step_id, log=spec.log, log_offset=offset)

    def query(self) -> dict[str, tuple[str, str]] | None:
        self._contact.record(self.answering)
        if not self.answering:
            return None
        return {step_id: (entry["name"], "RUNNING") for step_id, entry in self._entries().items()
                if "exit_code" not in entry and _alive(entry)}

    def refresh(self, steps: Iterable[Step]) -> dict[str, StepStatus]:
        rows = self.query()
        status: dict[str, StepStatus] = {}
        for step in steps:
            if step.returncode is not None:
                self._record_exit(step)
                status[step.spec_name] = "exited"
            elif rows is None:
                status[step.spec_name] = "unknown"
            elif step.slurm_step in rows:
                status[step.spec_name] = "running"
            else:
                status[step.spec_name] = "exited"
                if step.adopted:
                    code = self.exit_codes([step.slurm_step or ""]).get(step.slurm_step or "")
                    release(step, UNKNOWN_EXIT if code is None else code)
        return status

    def adopt(self, recorded: Mapping[str, str | None]) -> list[Step] | None:
        rows = self.query()
        if rows is None:
            return None
        alive = []
        with self._lock:
            for name, step_id in recorded.items():
                if step_id is None or rows.get(step_id, ("", ""))[0] != name or step_id in self._claimed:
                    fresh = [sid for sid, (n, _) in rows.items() if n == name and sid not in self._claimed]
                    step_id = max(fresh, key=_number) if fresh else None
                if step_id is not None:
                    self._claimed.add(step_id)
                    alive.append(stand_in(name, step_id, self._watcher))
        return alive

    def ended(self, name: str, step_id: str, code: int | None = None) -> Step:
        code = self.exit_codes([step_id]).get(step_id) if code is None else code
        step = stand_in(name, step_id, self._watcher)
        release(step, UNKNOWN_EXIT if code is None else code)
        return step

    def exit_codes(self, step_ids: Collection[str]) -> dict[str, int]:
        entries = self._entries()
        return {sid: int(entries[sid]["exit_code"]) for sid in step_ids if "exit_code" in entries.get(sid, {})}

    def cancel(self, step: Step, timeout_s: float, term_grace_s: float) -> None:
        """SIGTERM to the step's process group (as scancel would), a wait of timeout_s, then SIGTERM
        and SIGKILL term_grace_s apart. An adopted step: the same to its PID, then its stand-in exits."""
        if self.fence is not None:
            self.fence.check()
        assert step.proc is not None
        if step.adopted:
            entry = self._entries().get(step.slurm_step or "", {})
            self._stop_adopted(entry, timeout_s, term_grace_s)
            release(step, CANCELLED_EXIT)
            step.proc.wait(term_grace_s)
            return
        try:
            os.killpg(step.proc.pid, signal.SIGTERM)
            step.proc.wait(timeout_s)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            stop_process_group(step.proc, term_grace_s)
        step.proc.wait(term_grace_s)
        self._record_exit(step)

    def abandon(self, step: Step, wait_s: float) -> None:
        kill_process_group(step, wait_s)

    def rate_limited(self, step: Step) -> str | None:
        """As SLURM's backend: a local step that printed srun's rate-limit refusal stands for one."""
        return next((line for line in srun_lines(step) if rate_limited(line)), None)

    def count(self) -> StepCount:
        return StepCount(len(self._entries()), None, False)

    def close(self) -> None:
        if self._watcher is not None:
            self._watcher.close()

    # ------------------------------------------------------------------ the registry
    def _exited(self, step: Step) -> None:
        self._record_exit(step)
        if self._on_exit is not None:
            self._on_exit(step)

    def _record_exit(self, step: Step) -> None:
        """A launched step's exit code into the registry (SLURM's accounting of it)."""
        if step.adopted or step.slurm_step is None or step.returncode is None:
            return
        code = step.returncode if step.returncode >= 0 else 128 - step.returncode
        with self._lock:
            entry = self._entries().get(step.slurm_step)
            if entry is not None and "exit_code" not in entry:
                self._write(step.slurm_step, {**entry, "exit_code": code})

    def _stop_adopted(self, entry: dict[str, Any], timeout_s: float, term_grace_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for sig, until in ((signal.SIGTERM, deadline), (signal.SIGKILL, time.monotonic() + timeout_s + term_grace_s)):
            if not _alive(entry):
                return
            try:
                os.killpg(int(entry["pid"]), sig)
            except ProcessLookupError:
                return
            while _alive(entry) and time.monotonic() < until:
                time.sleep(_GONE_POLL_S)
        if _alive(entry):
            raise TimeoutError(f"local step {entry.get('name')} (pid {entry.get('pid')}) outlived SIGKILL")

    def _entries(self) -> dict[str, dict[str, Any]]:
        entries = {}
        for path in self.registry.glob(f"{self.job_id}.*.json"):
            try:
                entries[path.name[:-len(".json")]] = json.loads(path.read_text())
            except (OSError, ValueError):  # being replaced: a reader sees old or new, or none
                continue
        return entries

    def _next_number(self) -> int:
        return max((_number(sid) for sid in self._entries()), default=-1) + 1

    def _write(self, step_id: str, entry: Mapping[str, Any]) -> None:
        write_atomic(self.registry / f"{step_id}.json", json.dumps(entry), durable=False)


def _number(step_id: str) -> int:
    return int(step_id.rsplit(".", 1)[1])


def _start_time(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


def _alive(entry: Mapping[str, Any]) -> bool:
    """Whether the entry's process still runs (the same process: not a reused PID, not a zombie)."""
    try:
        proc = psutil.Process(int(entry["pid"]))
        return proc.create_time() == entry.get("started") and proc.status() != psutil.STATUS_ZOMBIE
    except (psutil.Error, KeyError, ValueError):
        return False
