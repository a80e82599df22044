"""What SLURM itself says about a job, for `slurmrl status`: its state while slurmctld holds it
(squeue, an ended job too until MinJobAge), else as the accounting recorded its end (sacct), and
which job dir a job id belongs to. Without accounting (no slurmdbd, or it is down) a job slurmctld
no longer holds is one SLURM does not know."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from contract.job_dir import JobDir
from contract.spec_loading import jobs_root
from slurm.client import SlurmClient, SlurmUnavailable

__all__ = ["JobNotFound", "SlurmJob", "SlurmUnavailable", "job_dir_of", "job_state", "sacct_states"]


class JobNotFound(ValueError):
    pass


@dataclass(frozen=True)
class SlurmJob:
    job_id: str
    state: str  # PENDING, RUNNING, COMPLETED, CANCELLED, FAILED, TIMEOUT, ...
    reason: str = ""  # squeue's reason of a pending job (JobHeldUser, BeginTime, Resources, ...)

    @property
    def queued(self) -> bool:
        return self.state in ("PENDING", "RUNNING", "SUSPENDED", "REQUEUED", "CONFIGURING", "COMPLETING",
                              "REQUEUE_HOLD", "RESIZING", "STOPPED")


def job_state(job_id: str, timeout_s: float) -> SlurmJob | None:
    """The job as squeue lists it, else as sacct recorded its end; None if neither knows it (sacct
    silent included). A heterogeneous job's state is its component 0's, where the supervisor runs."""
    queued = SlurmClient(timeout_s).require("squeue", "-h", "-t", "all", "-j", job_id, "-o", "%i|%T|%r",
                                            unknown_job_ok=True)
    rows = {row[0]: row[1:3] for line in queued.splitlines() if len(row := line.split("|")) >= 3}
    listed = rows.get(f"{job_id}+0") or rows.get(job_id)
    if listed:
        state, reason = listed
        return SlurmJob(job_id, state, "" if reason == "None" else reason)
    try:
        states = sacct_states(job_id, timeout_s)
    except SlurmUnavailable:
        return None
    return SlurmJob(job_id, states[-1]) if states else None


def sacct_states(job_id: str, timeout_s: float) -> list[str]:
    """The job's states as the accounting recorded them, a line per hetjob component
    ("CANCELLED by 0" -> CANCELLED); SlurmUnavailable if sacct does not answer."""
    ended = SlurmClient(timeout_s).require("sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State")
    return [line.split()[0] for line in ended.splitlines() if line.strip()]


def job_dir_of(job: str, timeout_s: float) -> JobDir:
    """A job dir as given, or the one a SLURM job id's Submitit log lives in (JOB_DIR/submitit/...),
    or, for a job SLURM has forgotten, the one under the default jobs folder with that id."""
    given = JobDir(Path(job).resolve())
    if given.spec.is_file():
        return given
    if not job.isdigit():
        raise JobNotFound(f"{job}: neither a job directory (no spec.yaml) nor a SLURM job id")
    try:
        shown = SlurmClient(timeout_s).require("scontrol", "show", "job", job, unknown_job_ok=True)
    except SlurmUnavailable as err:
        raise JobNotFound(f"job {job}: SLURM did not answer: {err}; or give its job directory") from None
    for field in shown.split():
        if field.startswith("StdOut="):
            candidate = JobDir(Path(field.split("=", 1)[1]).parent.parent)
            if candidate.spec.is_file():
                return candidate
    found = job_dir_by_id(job)
    if found is None:
        raise JobNotFound(f"job {job}: not a slurmrl job SLURM still knows, nor one under {jobs_root()}; "
                          "give its job directory")
    return found


def job_dir_by_id(job_id: str) -> JobDir | None:
    """The job dir under the default jobs folder ($SLURMRL_JOBS_DIR or ~/slurmrl-jobs) whose
    slurm_job_id is job_id: how a job SLURM has forgotten is still found by its id."""
    root = jobs_root()
    for marker in root.glob("*/slurm_job_id") if root.is_dir() else ():
        if marker.read_text().strip() == job_id:
            return JobDir(marker.parent)
    return None

