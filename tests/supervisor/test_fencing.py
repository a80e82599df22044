"""Fencing an older run of the job (supervisor/fencing.py): once the state store holds a newer run
(SLURM requeued the job without a cut-off node whose processes live on), the old supervisor
writes no state or event and launches or cancels no step, the new one takes the control socket
over, and the old trainer is told it is fenced on its next call and saves nothing."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from contract.job_dir import JobDir
from contract.control_protocol import (
    Call,
    CallerFenced,
    CallerRun,
    ControlClient,
    superseded,
)
from supervisor.adoption import left_over
from supervisor.control import ControlServer
from supervisor.events import EventLog
from supervisor.fencing import Fence, Fenced
from supervisor.state import JobState, StateStore, StepRecord
from supervisor.steps import Step, StepController, StepSpec
from tests.control_helpers import handler_table


@pytest.fixture
def job_dir() -> Iterator[JobDir]:
    path = Path(tempfile.mkdtemp(prefix="slurmrl-fence-"))  # short: a unix socket's path is limited
    yield JobDir(path)
    for child in path.iterdir():
        child.unlink()
    path.rmdir()


def newer_run_starts(job_dir: JobDir, job_id: str = "7", run: int = 1) -> None:
    """What the requeued job's supervisor writes first (Daemon.run)."""
    with StateStore(job_dir).update() as state:
        state.job_id, state.requeues = job_id, run


def test_the_old_supervisor_writes_no_state_or_event_once_a_newer_run_started(job_dir: JobDir) -> None:
    newer_run_starts(job_dir, run=0)
    fence = Fence(job_dir, "7", run=0)
    store, events = StateStore(job_dir, fence), EventLog(job_dir.events, fence)
    with store.update() as state:
        state.weight_version = 3  # the current run may write
    events.emit("mine")
    newer_run_starts(job_dir)
    saved = job_dir.state.read_text()
    with pytest.raises(Fenced, match="run 1 of job 7 has started"), store.update() as state:
        state.weight_version = 4
    events.emit("old")
    events.close()
    assert job_dir.state.read_text() == saved and json.loads(saved)["requeues"] == 1
    assert [json.loads(line)["kind"] for line in job_dir.events.read_text().splitlines()] == ["mine"]


def test_another_jobs_state_or_an_older_run_does_not_fence(job_dir: JobDir) -> None:
    assert not Fence(job_dir, "7", run=0).fenced  # no state yet
    newer_run_starts(job_dir, job_id="8", run=5)
    assert not Fence(job_dir, "7", run=0).fenced
    newer_run_starts(job_dir, job_id="7", run=1)
    assert not Fence(job_dir, "7", run=1).fenced and not Fence(job_dir, "7", run=2).fenced
    assert Fence(job_dir, "7", run=0).fenced


def test_the_old_supervisor_launches_and_cancels_no_step(job_dir: JobDir, tmp_path: Path) -> None:
    """Step ids start at 0 again after a requeue: an old `scancel 7.1` would hit the new run's."""
    newer_run_starts(job_dir)
    steps = StepController("7", 5.0, 5.0, fence=Fence(job_dir, "7", run=0))
    with pytest.raises(Fenced):
        steps.launch(StepSpec(name="engine-0", argv=("true",), nodes=("node2",), log=tmp_path / "x.log"))
    assert not (tmp_path / "x.log").exists()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        step = Step("engine-0", sleeper)
        step.slurm_step = "7.1"
        with pytest.raises(Fenced):
            steps.cancel(step, timeout_s=5, term_grace_s=1)
        assert sleeper.poll() is None  # srun (here its stand-in) is not signalled either
    finally:
        sleeper.kill()
        sleeper.wait(10)


def test_the_new_run_takes_the_socket_over_and_the_old_trainer_is_fenced(job_dir: JobDir,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    old = ControlServer(job_dir, handler_table({Call.STATUS: lambda: {"run": 0}}), run=CallerRun("7", 0))
    old.start()
    new = ControlServer(job_dir, handler_table({Call.STATUS: lambda: {"run": 1}}), run=CallerRun("7", 1))
    try:
        new.start(take_over=True)
        monkeypatch.setenv("SLURM_JOB_ID", "7")
        monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)  # run 0: SLURM sets it from the first requeue
        client = ControlClient(job_dir, timeout_s=10)
        with pytest.raises(CallerFenced, match="caller is of run 0 of job 7, this supervisor of run 1"):
            client.call(Call.STATUS)
        monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
        assert client.call(Call.STATUS) == {"run": 1}
        monkeypatch.setenv("SLURM_JOB_ID", "8")  # another job's process (a CLI in another allocation)
        monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
        assert client.call(Call.STATUS) == {"run": 1}
        old.close()  # the old one ends: the socket in its place is the new run's, and stays
        assert client.call(Call.STATUS) == {"run": 1}
    finally:
        old.close()
        new.close()
    assert not job_dir.control_socket.exists()


def test_the_old_trainer_sees_it_is_superseded(job_dir: JobDir, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    newer_run_starts(job_dir, run=0)
    assert not superseded(job_dir)
    newer_run_starts(job_dir, run=1)
    assert superseded(job_dir)
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    assert not superseded(job_dir)
    monkeypatch.delenv("SLURM_JOB_ID")  # outside SLURM (a local run): never fenced
    assert not superseded(job_dir)


def test_a_fenced_supervisor_kills_its_srun_clients_without_a_signal_to_slurm() -> None:
    """SIGKILL: srun cannot forward it as a cancel of its step id (now the newer run's)."""
    ignores_term = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"
    srun = subprocess.Popen([sys.executable, "-c", ignores_term], process_group=0)
    StepController("7", 5.0, 5.0).abandon(Step("trainer", srun), wait_s=10)
    assert srun.returncode == -9


def test_after_a_requeue_the_previous_runs_engine_steps_are_the_ones_to_stop(monkeypatch: pytest.MonkeyPatch) -> None:
    """SLURM requeues only the failed node's component of a heterogeneous job: the rollout
    component's engines of the old run may still run when the new run starts."""
    state = JobState(job_id="7", requeues=0, steps={
        "engine-0": StepRecord("engine-0", "engine", 1, ["node2"], slurm_step="8.1"),
        "engine-1": StepRecord("engine-1", "engine", 1, ["node3"], slurm_step=None),
        "router": StepRecord("router", "router", 0, ["node1"], slurm_step="7.0"),
        "trainer": StepRecord("trainer", "trainer", 0, ["node1"], slurm_step="7.3")})
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    assert left_over(state, "7") == {"engine-0": "8.1", "engine-1": None}  # router, trainer: requeued with the batch step
    assert left_over(state, "9") == {}  # another job's state
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    assert left_over(state, "7") == {}  # the same run (a watchdog restart adopts them instead)
