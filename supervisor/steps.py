"""SLURM step control (the SLURM backend of supervisor/step_control.py): launch steps into the job
with srun, learn their step ids, notice exits, cancel them, and adopt the ones a previous
supervisor left running. Every SLURM program runs through the job's SlurmClient (slurm/client.py),
which bounds each call, paces the launches and counts them against MaxStepCount.

SLURM is asked about all steps in one squeue call per cycle, never one per step; a failed or slow
query answers "unknown", never "dead", so a slurmctld that stops answering for a while is ridden out.
An adopted step's stand-in exits with the step's exit code (from SLURM's accounting) once squeue no
longer lists the step; on a cluster without accounting (sacct: "accounting storage is disabled") at
once, with UNKNOWN_EXIT, instead of waiting exit_code_wait_s for a record that never comes.

Seen on slurm 22.05: steps of het group K are listed and cancelled under that component's own
job id (hetjob 110 -> group 1 is job 111: steps "111.3"; "110+1.3" is refused by scancel), and
step numbers count up across all components of the hetjob.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable, Collection, Iterable, Mapping

from slurm.client import SlurmClient
from slurm.contact import SlurmContact
from slurm.pacing import rate_limited
from slurm.step_spec import SLURM_OWN_STEPS, StepSpec, srun_argv
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

_ACCOUNTING_POLL_S = 1.0  # between two asks to sacct for an ended step's exit code
_GONE_POLL_S = 0.5  # between two looks whether SLURM still lists a cancelled step
_UNFINISHED = {"PENDING", "RUNNING", "SUSPENDED", "COMPLETING", "REQUEUED", "RESIZING"}
_NO_ACCOUNTING = "accounting storage is disabled"  # what sacct says where AccountingStorageType is none


class StepController:
    """Launches, finds, cancels and adopts the steps of one SLURM job."""

    def __init__(self, job_id: str, query_timeout_s: float, exit_code_wait_s: float,
                 on_exit: Callable[[Step], None] | None = None, fence: Fence | None = None,
                 slurm: SlurmClient | None = None) -> None:
        """query_timeout_s: one squeue/sacct/scancel call; exit_code_wait_s: for slurmdbd to record
        the end of a step that squeue no longer lists; fence: a supervisor of an older run of the
        job launches and cancels nothing (Fenced), its step ids may be the newer run's."""
        self.job_id = job_id
        self.fence = fence
        self.slurm = slurm or SlurmClient(query_timeout_s)
        self.exit_code_wait_s = exit_code_wait_s
        self._component_ids: list[str] | None = None
        self._no_accounting = False  # sacct said the cluster keeps no accounting: no exit code will come
        self._claimed: set[str] = set()  # step ids already tied to a Step object
        self._watcher = ExitWatcher(on_exit) if on_exit is not None else None

    @property
    def contact(self) -> SlurmContact:
        """Whether SLURM answered of late (every call of the client)."""
        return self.slurm.contact

    def count(self) -> StepCount:
        budget = self.slurm.steps
        return StepCount(budget.launched, budget.limit, budget.nearing_limit)

    def launch(self, spec: StepSpec) -> Step:
        if self.fence is not None:
            self.fence.check()
        spec.log.parent.mkdir(parents=True, exist_ok=True)
        offset = log_offset(spec.log)
        with open(spec.log, "ab") as log:  # srun's own messages ("task 0: Killed") go there too
            proc = self.slurm.launch(srun_argv(self.job_id, spec), log, spec.env)
        step = Step(spec.name, proc, log=spec.log, log_offset=offset)
        if self._watcher is not None:
            self._watcher.watch(step)
        return step

    def launch_piped(self, spec: StepSpec) -> Step:
        """A step whose stdin and stdout are pipes to its srun's (spec.piped: a channel to the step;
        srun's own words and the step's stderr go to its log). Not watched: its reader sees it end."""
        if self.fence is not None:
            self.fence.check()
        spec.log.parent.mkdir(parents=True, exist_ok=True)
        offset = log_offset(spec.log)
        with open(spec.log, "ab") as log:
            proc = self.slurm.launch(srun_argv(self.job_id, spec), log, spec.env, piped=True)
        return Step(spec.name, proc, log=spec.log, log_offset=offset)

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
            if name not in SLURM_OWN_STEPS:
                rows[step_id] = (name, state)
                number = step_id.rsplit(".", 1)[-1]
                if number.isdigit():  # a predecessor's launches count too
                    self.slurm.steps.seen(int(number))
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
                alive.append(stand_in(name, step_id, self._watcher))
        return alive

    def ended(self, name: str, step_id: str, code: int | None = None) -> Step:
        """A step that ended while no supervisor watched it, as an adopted Step whose stand-in exits
        at once with its exit code: `code` where the caller knows it, else the accounting's
        (UNKNOWN_EXIT if it has none within exit_code_wait_s, or keeps none)."""
        deadline = time.monotonic() + self.exit_code_wait_s
        while code is None:
            code = self.exit_codes([step_id]).get(step_id)
            if code is not None or self._no_accounting or time.monotonic() >= deadline:
                break
            time.sleep(_ACCOUNTING_POLL_S)
        step = stand_in(name, step_id, self._watcher)
        release(step, UNKNOWN_EXIT if code is None else code)
        return step

    def exit_codes(self, step_ids: Collection[str]) -> dict[str, int]:
        """{step id: exit code} of the given steps that ended, from SLURM's accounting in one sacct
        call (128 + N for a step killed by signal N). A step whose end is not recorded is left out."""
        out = self.slurm.call("sacct", "-n", "-P", "-j", ",".join(step_ids), "-o", "JobIDRaw,State,ExitCode")
        self._no_accounting = self._no_accounting or _NO_ACCOUNTING in out.stderr
        codes = {}
        for line in out.stdout.splitlines() if out.ok else []:
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
            done = self.slurm.call("scancel", step.slurm_step)
            if done.timed_out:
                raise subprocess.TimeoutExpired(["scancel", step.slurm_step], self.slurm.timeout_s)
        assert step.proc is not None
        if step.adopted:
            self._wait_gone(step, timeout_s)
            self._claimed.discard(step.slurm_step or "")  # free: a requeued component numbers its steps from 0 again
            release(step, CANCELLED_EXIT)
            step.proc.wait(term_grace_s)
            return
        try:
            step.proc.wait(timeout_s)
            return
        except subprocess.TimeoutExpired:
            pass
        # A step SLURM never started (still pending) or a slurmctld that does not answer:
        # srun itself cancels its step on SIGTERM.
        stop_process_group(step.proc, term_grace_s)

    def abandon(self, step: Step, wait_s: float) -> None:
        """A fenced supervisor's step: SIGKILL its srun (or stand-in), which sends SLURM nothing
        more (a SIGTERM would have srun cancel the step by its id: the newer run's step now)."""
        kill_process_group(step, wait_s)

    def rate_limited(self, step: Step) -> str | None:
        """srun's words if slurmctld refused this launch for its rate limit; the pace halves then."""
        said = next((line for line in srun_lines(step) if rate_limited(line)), None)
        if said is not None:
            self.slurm.pacer.refused()
        return said

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

    def _settle(self, ended: list[Step]) -> None:
        """Release the stand-ins of adopted steps that ended, once their exit codes are known."""
        if not ended:
            return
        codes = self.exit_codes([step.slurm_step for step in ended if step.slurm_step is not None])
        now = time.monotonic()
        for step in ended:
            step.gone_since = step.gone_since or now
            code = codes.get(step.slurm_step or "")
            if code is not None or self._no_accounting or now - step.gone_since > self.exit_code_wait_s:
                release(step, UNKNOWN_EXIT if code is None else code)

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
        result = self.slurm.call("squeue", "-h", *args)
        return result.stdout if result.ok else None


def _exit_code(state: str, exit_code: str) -> int:
    """sacct's State and ExitCode ("CODE:SIGNAL") as a shell would report the step's end."""
    code, _, signum = exit_code.partition(":")
    value = 128 + int(signum) if int(signum or 0) else int(code)
    # A step that did not complete (cancelled, node failure, time limit) can show 0:0: not a success.
    return UNKNOWN_EXIT if value == 0 and state != "COMPLETED" else value

