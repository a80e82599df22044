"""The job's end as SLURM moves it, the lead a save needs before it, and what the supervisor does
when no save would end in time (issue 29, items 5 and 7), in seconds and without SLURM: the job's
end is a stand-in for squeue's answer here, the trainer a plain process (LocalSteps).
tests/integration/test_deadline.py runs the whole of it in a toy job on the devcluster."""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path

import pytest

from contract.job_dir import Heartbeat, JobDir, Metric, Phase, write_heartbeat
from contract.spec import FaultToleranceSpec, JobSpec, RolloutSpec, TrainerSpec
from supervisor import cli, deadline, slurm_jobs
from supervisor.deadline import REQUEUE_MARGIN_S, EndTime, StopCosts, no_time_to_save
from supervisor.launcher import TRAINER
from supervisor.local_steps import LocalSteps
from supervisor.preemption import Preemption, SlurmJob
from supervisor.requeue import REQUEUE, REQUEUE_UNSAVED, requeues
from supervisor.state import StateStore, StepRecord
from supervisor.step_control import Step
from supervisor.trainer_files import Pace
from tests.supervisor.job_context import two_engine_job
from tests.supervisor.recovery_wiring import wire_recovery

EXIT_WAIT_S = 10.0  # a killed stand-in trainer's exit reaching the inbox


class StandInJob:
    """preemption.SlurmJob's end_time: SLURM's answer, which a test moves (None: no answer)."""

    def __init__(self, end: float | None) -> None:
        self.end, self.answers, self.asked = end, True, 0

    def end_time(self, default: float | None = None) -> float | None:
        self.asked += 1
        return self.end if self.answers else default


@pytest.fixture
def every_ask_refreshes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(deadline, "END_TIME_REFRESH_S", 0.0)


def test_the_end_time_follows_slurm_and_says_when_it_moves(every_ask_refreshes) -> None:
    job, moves = StandInJob(1000.0), []
    ends = EndTime(job.end_time, lambda old, new: moves.append((old, new)))
    assert ends.current() == 1000.0 and moves == []
    job.end = 5000.0  # scontrol update TimeLimit=...: extended
    assert ends.current() == 5000.0
    job.end = 2000.0  # shortened
    assert ends.current() == 2000.0
    job.answers = False  # slurmctld silent: the end as last known
    assert ends.current() == 2000.0
    job.answers, job.end = True, None  # TimeLimit=UNLIMITED
    assert ends.current() is None
    assert moves == [(1000.0, 5000.0), (5000.0, 2000.0), (2000.0, None)]


def test_the_end_time_is_asked_at_most_every_refresh_interval() -> None:
    job = StandInJob(1000.0)
    ends = EndTime(job.end_time, lambda old, new: None)
    for _ in range(5):
        ends.current()
    assert job.asked == 1 and deadline.END_TIME_REFRESH_S >= 1.0


def test_preemption_acts_on_the_current_end(every_ask_refreshes) -> None:
    now = time.time()
    job = StandInJob(now + 100)
    preemption = Preemption(grace_s=60, job=job)  # type: ignore[arg-type]
    assert preemption.check() is None
    job.end = now + 1000  # extended: the old end's 100 s would now be under a 200 s lead
    assert preemption.check(lead_s=200) is None
    job.end = now + 150  # shortened
    reason = preemption.check(lead_s=200)
    assert reason is not None and reason.startswith("less than 200 s left before the job's end")
    assert preemption.deadline == now + 150 and preemption.at_end


def test_the_lead_is_the_grace_or_what_a_save_now_takes() -> None:
    assert StopCosts(save_s=10, train_s=5, boundary_s=20).lead(grace_s=600, check_every_s=10) == 600
    # the monitor's cycle on top: a check may come that late
    assert StopCosts(save_s=101, train_s=5, boundary_s=120).lead(grace_s=40, check_every_s=10) == \
        101 + 5 + REQUEUE_MARGIN_S + 10


def _beat(phase: Phase, began_s_ago: float) -> Heartbeat:
    now = time.time()
    return Heartbeat(phase, now, 7, since=now - began_s_ago)


def test_a_save_that_cannot_end_in_time_is_neither_started_nor_waited_for() -> None:
    costs = StopCosts(save_s=101, train_s=5, boundary_s=120)
    # the case: a save of ~101 s with 40 s left
    assert "a save takes ~101 s" in no_time_to_save(40, costs, _beat(Phase.ROLLOUT, 3))
    assert "after ~5 s of training" in no_time_to_save(110, costs, _beat(Phase.TRAIN, 1))
    assert no_time_to_save(130, costs, _beat(Phase.TRAIN, 1)) is None
    # a save under way since 90 s needs ~11 s more: it ends in time with 30 s left, not with 20
    assert no_time_to_save(30, costs, _beat(Phase.SAVE, 90)) is None
    assert "the save under way needs ~11 s more" in no_time_to_save(20, costs, _beat(Phase.SAVE, 90))
    assert no_time_to_save(5, costs, None) is None  # no trainer runs: nothing to end


def _metrics(job_dir: JobDir, *lines: dict) -> None:
    job_dir.root.mkdir(parents=True, exist_ok=True)
    with open(job_dir.metrics, "a") as f:
        for line in lines:
            f.write(json.dumps(line) + "\n")


def test_the_save_and_training_times_are_the_slowest_recent_or_the_save_under_way(tmp_path: Path) -> None:
    job_dir = JobDir(tmp_path)
    pace = Pace(job_dir)
    assert pace.costs(None) == StopCosts(0.0, 0.0, 0.0)
    step = {Metric.ROLLOUT_SECONDS: 2.0, Metric.TRAIN_SECONDS: 3.0, Metric.PUBLISH_SECONDS: 1.0}
    slow = {**step, Metric.TRAIN_SECONDS: 9.0}
    _metrics(job_dir, {**step, Metric.SAVE_SECONDS: 50.0}, {**slow, Metric.SAVE_SECONDS: 20.0}, step)
    assert pace.costs(None) == StopCosts(save_s=50.0, train_s=10.0, boundary_s=62.0)
    _metrics(job_dir, *[step] * 25)  # the saves scrolled out of the recent lines: the last one known
    assert pace.costs(None).save_s == 50.0
    assert pace.costs(_beat(Phase.SAVE, 80)).save_s == pytest.approx(80, abs=1)  # slower than any before


def test_outcomes_that_requeue() -> None:
    assert requeues(REQUEUE) and requeues(f"{REQUEUE_UNSAVED} (40 s left): it resumes from x")
    assert not requeues("completed") and not requeues("stopped by user")


@pytest.fixture
def wired(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The supervisor's trainer watch and requeue over a test job (LocalSteps: no SLURM); its
    trainer a plain process that runs until it is ended; SLURM's end a stand-in, 40 s from now."""
    save, end = tmp_path / "save", time.time() + 40
    ft = FaultToleranceSpec(use_fault_tolerance=True, preempt_grace=10, step_stop_timeout=5.0, step_term_grace=1.0,
                            slurm_command_timeout=5.0)
    spec = JobSpec(job_dir=str(tmp_path / "job"), rollout=RolloutSpec(engine="cpu", num_engines=2),
                   trainer=TrainerSpec(train_args=["--save", str(save)]), fault_tolerance=ft)
    job, router = two_engine_job(spec, head="n0", node="n1", het_group=1)
    monkeypatch.setattr(SlurmJob, "end_time", lambda self, default=None: end)
    wiring = wire_recovery(job, router, LocalSteps(job.layout.job_id, tmp_path / "steps", on_exit=job.inbox.put))
    save.mkdir()
    (save / "latest_checkpointed_iteration.txt").write_text("4")
    (save / "iter_0000004").mkdir()
    wiring.launcher.launch(TRAINER, "trainer", [sys.executable, "-c", "import time; time.sleep(60)"], ("n0",), 0)
    wiring.trainer.adopted()  # its heartbeat counts from now
    try:
        yield job, wiring
    finally:
        wiring.stop()
        job.events.close()
        job.client.close()


def _kinds(job) -> list[str]:
    return [json.loads(line)["kind"] for line in job.dir.events.read_text().splitlines()]


def test_the_trainer_is_ended_without_a_save_that_would_not_end_in_time(wired) -> None:
    """40 s before the end, a save of ~101 s (the recent ones) is not started: the trainer is ended
    at once, and its exit is no failure; the job requeues from its last complete checkpoint."""
    job, wiring = wired
    _metrics(job.dir, {Metric.ROLLOUT_SECONDS: 2.0, Metric.TRAIN_SECONDS: 3.0, Metric.SAVE_SECONDS: 101.0})
    write_heartbeat(job.dir, Phase.ROLLOUT, 5)
    wiring.trainer.check_deadline()
    step: Step = job.inbox.get(timeout=EXIT_WAIT_S)
    outcome = wiring.trainer.on_exit(step)
    assert outcome is not None and outcome.startswith(REQUEUE_UNSAVED) and requeues(outcome)
    assert "iter_0000004 and the rollout journal" in outcome, outcome
    assert _kinds(job)[-3:] == ["preemption", "no_time_to_save", "trainer_stopped"]
    assert "save_now" not in _kinds(job) and "trainer_failed" not in _kinds(job)


def test_a_save_under_way_that_ends_in_time_is_waited_for(wired) -> None:
    job, wiring = wired
    _metrics(job.dir, {Metric.ROLLOUT_SECONDS: 2.0, Metric.TRAIN_SECONDS: 3.0, Metric.SAVE_SECONDS: 30.0})
    write_heartbeat(job.dir, Phase.SAVE, 5, since=time.time() - 15)  # ~15 s more, 40 s left
    wiring.trainer.check_deadline()
    assert wiring.launcher.current(TRAINER).returncode is None and wiring.trainer.requeue.unsaved is None
    assert "preemption" in _kinds(job) and "no_time_to_save" not in _kinds(job)


def test_the_lead_holds_the_longest_recent_monitor_cycle(wired) -> None:
    """A save of 12 s and 40 s left: no stop while the monitor checks often (12 + 15 + 10, the
    interval, < 40), a stop once a check came 14 s after the one before (a slow probe cycle): the
    next may come as late, with too little left to end a save begun meanwhile."""
    job, wiring = wired
    _metrics(job.dir, {Metric.ROLLOUT_SECONDS: 2.0, Metric.TRAIN_SECONDS: 0.0, Metric.SAVE_SECONDS: 12.0})
    write_heartbeat(job.dir, Phase.ROLLOUT, 5)
    requeue = wiring.trainer.requeue
    for _ in range(3):
        wiring.trainer.check_deadline()
    assert "preemption" not in _kinds(job)
    requeue._checked_at -= 14  # the last check, as long ago as a slow cycle
    wiring.trainer.check_deadline()
    assert "preemption" in _kinds(job) and requeue.unsaved is None


@pytest.mark.parametrize("ended_by, kind", [(signal.SIGUSR1, "trainer_stopped"), (signal.SIGKILL, "trainer_failed")])
def test_the_save_signal_reaching_an_ending_trainer_is_no_failure(wired, ended_by: int, kind: str) -> None:
    """Exit 138 after the supervisor's save-now: SIGUSR1's default action, which Python restores as
    it exits. A trainer that dies otherwise meanwhile is still reported as failed; either way the
    preempted job requeues."""
    job, wiring = wired
    wiring.trainer.requeue.preemption.decide("the time limit is near")
    wiring.trainer.requeue.save_now_sent = True
    step = wiring.launcher.current(TRAINER)
    step.proc.send_signal(ended_by)  # the stand-in has no handler: it ends as an exiting trainer does
    step.proc.wait(EXIT_WAIT_S)
    assert wiring.trainer.on_exit(step) == REQUEUE
    other = "trainer_failed" if kind == "trainer_stopped" else "trainer_stopped"
    assert kind in _kinds(job) and other not in _kinds(job)


def test_status_of_a_job_slurm_ended_names_its_last_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SLURM ended the job mid-save (TIMEOUT) with its supervisor: the state it last wrote holds an
    old checkpoint and healthy steps. Status says the job ended, and what the tracker holds."""
    job, save = JobDir(tmp_path / "job"), tmp_path / "save"
    job.root.mkdir()
    job.spec.write_text(JobSpec(name="x", trainer=TrainerSpec(train_args=["--save", str(save)])).to_yaml())
    with StateStore(job).update() as state:
        state.job_id, state.last_checkpoint = "3", str(save / "iter_0000002")
        state.steps[TRAINER] = StepRecord(TRAINER, "trainer", 0, ["node1"], state="healthy")
    save.mkdir()
    (save / "iter_0000004").mkdir()
    (save / "latest_checkpointed_iteration.txt").write_text("4")
    monkeypatch.setattr(cli, "_slurm_job", lambda job_dir: slurm_jobs.SlurmJob("3", "TIMEOUT"))
    text, code, over = cli._status_text(job, since=None)
    assert over and "ended: SLURM says TIMEOUT" in text
    assert f"last checkpoint {save / 'iter_0000004'}" in text, text
    assert " healthy " not in text and " ended " in text, text


def test_the_recent_metrics_are_read_from_the_end_of_a_long_file(tmp_path: Path, monkeypatch) -> None:
    """The supervisor reads them after every rollout: a long run's file is not read whole."""
    from contract import job_dir as contract_job_dir

    job_dir = JobDir(tmp_path)
    _metrics(job_dir, *[{Metric.ROLLOUT_ID: k, "pad": "x" * 50} for k in range(200)])
    monkeypatch.setattr(contract_job_dir, "METRICS_TAIL_BYTES", 1000)  # ~14 lines, the first one cut
    assert [m[Metric.ROLLOUT_ID] for m in contract_job_dir.read_metrics(job_dir, 5)] == [195, 196, 197, 198, 199]
    assert len(contract_job_dir.read_metrics(job_dir, 100)) < 15
