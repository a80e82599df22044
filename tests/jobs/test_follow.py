"""`slurmrl submit --wait` (jobs/follow.py) with the accounting silent: the job is followed with
squeue, then by the outcome its supervisor left in the job dir; the silence is said once. SLURM's
answers are scripted here with the texts SLURM 22.05 prints (a devcluster run with slurmdbd
unreachable: tests/jobs/test_submit_devcluster.py)."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from contract.job_dir import JobDir
from jobs.follow import follow
from slurm.client import Reply, SlurmClient
from supervisor.state import StateStore

JOB = "4242"
SACCT_DOWN = Reply("sacct", 1, "", "sacct: error: slurm_persist_conn_open_without_init: failed to open persistent "
                   "connection to host:10.200.0.1:17819: Connection refused\nsacct: error: Sending PersistInit msg: "
                   "Connection refused\nsacct: error: Problem talking to the database: Connection refused\n")
SQUEUE_GONE = Reply("squeue", 1, "", "slurm_load_jobs error: Invalid job id specified\n")


def _queued(state: str) -> Reply:
    """squeue -h -j JOB -t all -o %i|%T of a heterogeneous job: a line per component."""
    return Reply("squeue", 0, f"{JOB}+0|{state}\n{JOB}+1|{state}\n")


def _accounted(*states: str) -> Reply:
    return Reply("sacct", 0, "".join(f"{JOB}+{k}|{state}\n" for k, state in enumerate(states)))


class ScriptedSlurm(SlurmClient):
    """SLURM's answers, in order, per program: squeue's each once (a look past them fails the test:
    no endless loop), sacct's last one repeating (the accounting stays as it last was)."""

    def __init__(self, sacct: list[Reply], squeue: list[Reply]) -> None:
        super().__init__()
        self.script = {"sacct": list(sacct), "squeue": list(squeue)}
        self.asked: list[str] = []

    def call(self, program: str, *args: str, timeout_s: float | None = None) -> Reply:
        assert "-j" in args and JOB in args, args
        self.asked.append(program)
        replies = self.script[program]
        if program == "sacct" and len(replies) == 1:
            return replies[0]
        assert replies, f"{program} asked once more than scripted: the follow did not end"
        return replies.pop(0)


def _job_dir(tmp_path: Path, stop_reason: str | None, job_id: str = JOB) -> JobDir:
    job_dir = JobDir(tmp_path / "job")
    job_dir.root.mkdir()
    if stop_reason is not None:
        with StateStore(job_dir).update() as state:  # as the supervisor leaves it
            state.job_id, state.stop_reason = job_id, stop_reason
    return job_dir


def _follow(job_dir: JobDir, slurm: ScriptedSlurm) -> tuple[str, list[str]]:
    out = io.StringIO()
    state = follow(JOB, job_dir, interval_s=0, out=out, client=slurm)
    return state, out.getvalue().splitlines()


def test_without_accounting_the_job_is_followed_by_squeue_then_its_job_dir(tmp_path: Path) -> None:
    job_dir = _job_dir(tmp_path, "completed")
    slurm = ScriptedSlurm([SACCT_DOWN], [_queued("PENDING"), _queued("RUNNING"), _queued("RUNNING"), SQUEUE_GONE])
    state, lines = _follow(job_dir, slurm)
    assert state == "COMPLETED"
    assert lines == [
        f"job {JOB}: accounting does not answer (sacct: error: Problem talking to the database: Connection refused); "
        f"following the job with squeue, then its job dir {job_dir.root}",
        f"job {JOB}: PENDING (squeue)", f"job {JOB}: RUNNING (squeue)",
        f"job {JOB}: COMPLETED (from the job dir: completed)"]
    assert slurm.asked.count("sacct") == 4  # asked at every look (it may come back), said once


def test_a_final_state_squeue_still_lists_ends_the_follow(tmp_path: Path) -> None:
    """squeue lists an ended job for MinJobAge: its component 0's state (the batch step's) is the job's."""
    slurm = ScriptedSlurm([SACCT_DOWN], [_queued("RUNNING"),
                                         Reply("squeue", 0, f"{JOB}+0|FAILED\n{JOB}+1|COMPLETED\n")])
    state, lines = _follow(_job_dir(tmp_path, None), slurm)
    assert state == "FAILED" and lines[-1] == f"job {JOB}: FAILED (squeue)"


@pytest.mark.parametrize("stop_reason, job_id, ended", [
    ("failed: trainer exited with code 1 (see logs/trainer.log)", JOB, "FAILED"),
    ("ended by SLURM (TIMEOUT) after the trainer saved", JOB, "TIMEOUT"),
    ("stopped by user", JOB, "COMPLETED"),  # the supervisor returned: the batch step exited 0
    ("preempted: saved, then requeued", JOB, "UNKNOWN"),  # requeued, then forgotten: the job dir cannot say
    ("completed", "17", "UNKNOWN"),  # another job's state
    (None, JOB, "UNKNOWN"),  # no supervisor state: it never started
])
def test_the_job_dir_says_how_a_job_slurm_forgot_ended(tmp_path: Path, stop_reason: str | None, job_id: str,
                                                       ended: str) -> None:
    job_dir = _job_dir(tmp_path, stop_reason, job_id)
    state, lines = _follow(job_dir, ScriptedSlurm([SACCT_DOWN], [_queued("RUNNING"), SQUEUE_GONE]))
    assert state == ended
    if ended == "UNKNOWN":
        assert lines[-1] == f"job {JOB}: UNKNOWN (ended; its supervisor wrote no outcome: see {job_dir.submitit})"
    else:
        assert lines[-1] == f"job {JOB}: {ended} (from the job dir: {stop_reason})"


def test_with_accounting_its_states_are_the_job_s(tmp_path: Path) -> None:
    """sacct answers: squeue is asked only while the accounting has not recorded the job yet."""
    slurm = ScriptedSlurm([Reply("sacct", 0, ""), _accounted("RUNNING", "RUNNING"),
                           _accounted("CANCELLED by 0", "CANCELLED by 0")], [_queued("PENDING")])
    state, lines = _follow(_job_dir(tmp_path, None), slurm)
    assert state == "CANCELLED"
    assert lines == [f"job {JOB}: PENDING", f"job {JOB}: RUNNING", f"job {JOB}: CANCELLED"]
    assert slurm.asked == ["sacct", "squeue", "sacct", "sacct"]


def test_slurmctld_silent_too_is_waited_for_and_said_once(tmp_path: Path) -> None:
    silent = Reply("squeue", None, why="timed out: squeue did not answer within 30 s")
    slurm = ScriptedSlurm([SACCT_DOWN], [_queued("RUNNING"), silent, silent, _queued("COMPLETED")])
    state, lines = _follow(_job_dir(tmp_path, None), slurm)
    assert state == "COMPLETED"
    assert lines[1:] == [f"job {JOB}: RUNNING (squeue)",
                         f"job {JOB}: slurmctld does not answer either (timed out: squeue did not answer within "
                         "30 s); waiting for it", f"job {JOB}: COMPLETED (squeue)"]
