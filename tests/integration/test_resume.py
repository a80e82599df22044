"""Preemption and exact resume on the devcluster (the toy job, real router, CPU engines, the real
trainer, no mocks). Every interrupted run is compared with one uninterrupted run of the same
flags: the same rollout ids once each, and the same rewards, losses, grad norms and versions.

- SLURM's warning signal with a long grace: the trainer saves at its rollout boundary, the job
  requeues itself and resumes.
- Eval is on (a tiny set before training and after every third rollout): the resumed runs'
  eval numbers equal the uninterrupted run's.
- With a short grace the trainer saves at once: a signal during a checkpoint save leaves that
  save whole and valid; a signal while a rollout is being generated abandons the rollout (it is
  generated again after the resume).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

from ckpt_tools.tracker import iteration_dirname, read_tracker
from rollout.toy_task import write_toy_data
from slurm.devcluster.daemons import wait_for
from tests.integration.test_rl_job import (
    STATUS_POLL_S,
    assert_never_stale,
    background_job,
    events,
    heartbeat,
    rollouts_done,
    status,
    submit,
)
from tests.slurm_helpers import listening_pids, wait_job_gone
from trainer import checkpoint

# --adam-eps 1: Adam's first steps are about lr * sign(g), so a last-bit difference between two runs
# (see `same` below) in a near-zero gradient element would flip a weight by 2 lr and move every later
# grad norm (seen in CI: 0.1% at rollout 4); with eps 1 the update follows the gradient. What these
# tests prove, that a resume restores everything, is untouched.
FLAGS = ("--num-rollout", "14", "--save-interval", "100", "--rollout-batch-size", "8", "--eval-interval", "3",
         "--n-samples-per-eval-prompt", "2", "--eval-temperature", "0.7", "--adam-eps", "1")
COMPARED = ("reward_mean", "loss", "grad_norm", "weight_version")
EVAL_SET = "toy"
CATCH_GENERATING_S = 300  # bound on catching the trainer mid-generation (see its use)


def metrics(job_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (job_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def eval_flags(tmp_path_factory) -> tuple[str, ...]:
    evals = write_toy_data(tmp_path_factory.mktemp("eval") / "eval.jsonl", num_prompts=4, seed=1)
    return ("--eval-prompt-data", EVAL_SET, str(evals))


@pytest.fixture(scope="module")
def uninterrupted(devcluster, toy, eval_flags, tmp_path_factory) -> Iterator[Callable[[], list[dict]]]:
    """The uninterrupted run's metrics, waited for when first asked: the run goes on beside the first
    interrupted job (whose test compares with it only at its end)."""
    job_dir = tmp_path_factory.mktemp("whole") / "job"
    rows: list[dict] = []

    def ended() -> list[dict]:
        if not rows:
            wait_job_gone(job_id, timeout_s=600)
            rows.extend(metrics(job_dir))
            assert [m["rollout_id"] for m in rows if f"eval/{EVAL_SET}" in m] == [2, 5, 8, 11], "slime's eval schedule"
            assert f"before_train/eval/{EVAL_SET}" in rows[0] and f"eval/{EVAL_SET}-pass@2" in rows[2]
        return rows

    with background_job(toy, job_dir, *FLAGS, *eval_flags) as job_id:
        yield ended


# Losses and norms may differ in their last bits between two runs from the same start. The GRPO
# loss on policy is a sum of advantages times ratios of ~1, so ~0: seen in CI, rollout 0's came out
# -9.3e-10 in one run and -4.2e-7 in another, and the first rollout after a resume -7.5e-9 against
# -1.6e-6 (its grad norm 1.1e-5 apart, the next rollouts' 1e-7). So they are compared to 1e-4
# relative / 1e-5 absolute, ten times the largest noise seen. Samples, rewards and versions stay
# exact, and a resume that repeats or skips a rollout fails the id check.
def same(x: object, y: object) -> bool:
    return x == y if not isinstance(x, float) else y == pytest.approx(x, rel=1e-4, abs=1e-5)


def assert_same_run(uninterrupted: Callable[[], list[dict]], job_dir: Path) -> None:
    expected, got = uninterrupted(), metrics(job_dir)
    assert [m["rollout_id"] for m in got] == list(range(len(expected))), "a rollout id was skipped or repeated"
    for x, y in zip(expected, got):
        for key in COMPARED:
            assert same(x[key], y[key]), f"rollout {x['rollout_id']}: {key} {x[key]} != {y[key]}"
        evals = [{k: v for k, v in m.items() if "eval/" in k} for m in (x, y)]
        assert evals[0] == evals[1], f"rollout {x['rollout_id']}: eval {evals[0]} != {evals[1]}"
    assert_never_stale(job_dir)


def preempt(job_id: str) -> None:
    subprocess.run(["scancel", "--batch", "--signal=USR1", job_id], check=True)


def resumed_at(job_dir: Path) -> list[int]:
    """The rollout each trainer start resumed at, from the trainer's log."""
    log = (job_dir / "logs" / "trainer.log").read_text()
    return [int(n) for n in re.findall(r"resumed from \S+: next rollout (\d+)", log)]


def replayed_after(job_dir: Path, resume: int) -> list[int]:
    """The rollouts the trainer replayed from the rollout journal after its `resume`-th resume (0: the first;
    -1: the whole log, for a run that found no checkpoint and replays from its start)."""
    log = (job_dir / "logs" / "trainer.log").read_text()
    after = re.split(r"resumed from \S+: next rollout", log)[resume + 1]
    return [int(n) for n in re.findall(r"rollout (\d+): replayed from the rollout journal", after)]


def test_preempted_job_saves_requeues_and_resumes_exactly(uninterrupted, toy, eval_flags, tmp_path: Path) -> None:
    """SLURM's warning signal (scancel --signal=USR1 --batch, as before a preemption or the time
    limit): the trainer saves at its rollout boundary, the job requeues itself, the new supervisor
    resumes from that checkpoint. Then `scontrol requeue` (SLURM ends the job at once: SIGTERM,
    KillWait, SIGKILL): the trainer saves on SIGTERM if it can, and the requeued job loses no rollout."""
    job_dir = tmp_path / "job"
    job_id = submit(toy, job_dir, *FLAGS, *eval_flags)
    try:
        wait_for(lambda: rollouts_done(job_dir) >= 4, 300, "a few rollouts")
        preempt(job_id)
        wait_for(lambda: events(job_dir, "requeue"), 300, "the requeue")
        wait_for(lambda: len(resumed_at(job_dir)) == 1 and rollouts_done(job_dir) >= 8, 300, "the resumed run")
        done = rollouts_done(job_dir)
        subprocess.run(["scontrol", "requeue", job_id], check=True)
        wait_for(lambda: len(resumed_at(job_dir)) == 2, 300, "the run resumed after scontrol requeue")
        wait_job_gone(job_id, timeout_s=600)
        # srun turns the SIGTERM SLURM sends it into a SIGKILL of its step at once ("srun: forcing job
        # termination"), so the trainer's save on its own SIGTERM races that kill. What it had not
        # saved, the rollout journal kept: nothing done before the requeue is generated again.
        resumed, replayed = resumed_at(job_dir)[1], replayed_after(job_dir, resume=1)
        assert replayed == list(range(resumed, resumed + len(replayed))) and resumed + len(replayed) >= done, \
            (resumed, replayed, done)
    finally:
        subprocess.run(["scancel", job_id], capture_output=True)
    state = status(job_dir)
    assert state["stop_reason"] == "completed" and state["requeues"] == 2, state
    preempted = events(job_dir, "preemption")
    # the warning, then `scontrol requeue`'s SIGTERM to the batch step, which also saves at once
    assert "warning signal" in preempted[0]["reason"] and all("SIGTERM" in p["reason"] for p in preempted[1:])
    assert len(preempted) <= 2, preempted
    sigterm = min((p["time"] for p in preempted if "SIGTERM" in p["reason"]), default=float("inf"))
    early = [e for e in events(job_dir, "save_now") if e["time"] < sigterm]
    assert not early, "a 120 s grace covers the rollout boundary (only a SIGTERM saves at once)"
    assert_same_run(uninterrupted, job_dir)


def stop_mid_save(job_dir: Path, save_dir: Path) -> int:
    """SIGSTOP the trainer while a checkpoint is half-written (its temporary folder exists);
    returns the trainer's pid. A save caught just after it finished is let go and the next tried."""
    def caught() -> bool:
        beat = heartbeat(job_dir)
        if beat.get("phase") != "save":
            return False
        os.kill(beat["pid"], signal.SIGSTOP)
        if heartbeat(job_dir) == beat and list(save_dir.glob(".iter_*.tmp-*")):
            return True
        os.kill(beat["pid"], signal.SIGCONT)
        return False

    wait_for(caught, 120, "the trainer inside a checkpoint save", interval_s=0.002)
    return heartbeat(job_dir)["pid"]


def freeze_during_rollout(job_dir: Path, engines: list[int]) -> None:
    """SIGSTOP the engines while rank 0 generates a rollout (its heartbeat still says so a second
    later); a rollout that finished first is let go and the next one tried."""
    def caught() -> bool:
        beat = heartbeat(job_dir)
        # After rollouts 2, 5, 8, 11 (--eval-interval 3) an eval, which also beats "rollout", runs on
        # the engines: only a training rollout's generation can be abandoned.
        if beat.get("phase") != "rollout" or beat.get("rollout_id", 0) % 3 == 2:
            return False
        for pid in engines:
            os.kill(pid, signal.SIGSTOP)
        time.sleep(1)
        if heartbeat(job_dir) == beat:
            return True
        for pid in engines:
            os.kill(pid, signal.SIGCONT)
        return False

    # Catching it mid-generation takes tries (each freezes the engines for 1 s): 120 s ran out once in CI
    # under the second xdist worker's load.
    wait_for(caught, CATCH_GENERATING_S, "the trainer generating a rollout", interval_s=0.002)


def _each_engine_listening(job_dir: Path, pids: list[int]) -> bool:
    """Whether each engine step of the job has one process listening on its URL; pids: theirs."""
    found = [listening_pids(step["url"]) if step.get("url") else set()
             for name, step in status(job_dir)["steps"].items() if name.startswith("engine")]
    pids[:] = [pid for each in found for pid in each]
    return bool(found) and all(len(each) == 1 for each in found)


def test_short_grace_saves_at_once(uninterrupted, time_limited, toy, eval_flags, tmp_path: Path) -> None:
    """preempt_grace 1 s is shorter than any rollout plus save: the supervisor has the trainer
    save at once (save_now). Once during a checkpoint save, once during a rollout. (time_limited:
    that test's job runs meanwhile.)"""
    job_dir = tmp_path / "job"
    job_id = submit(toy, job_dir, *FLAGS, *eval_flags, "--preempt-grace", "1", "--save-interval", "1")
    save_dir = job_dir / "checkpoints"
    stopped: list[int] = []
    try:
        wait_for(lambda: rollouts_done(job_dir) >= 2, 300, "a few rollouts")
        # 1. The signal arrives while the trainer is frozen half-way through a save.
        trainer = stop_mid_save(job_dir, save_dir)
        stopped.append(trainer)
        preempt(job_id)
        wait_for(lambda: events(job_dir, "save_now"), 60, "the supervisor to ask for a save now")
        os.kill(trainer, signal.SIGCONT)
        wait_for(lambda: events(job_dir, "requeue"), 300, "the first requeue")
        latest = save_dir / iteration_dirname(read_tracker(save_dir))
        assert checkpoint.validate(latest) is None and checkpoint.find_loadable(save_dir) == latest

        # 2. The signal arrives while rank 0 waits for a rollout: both engines are frozen.
        wait_for(lambda: len(events(job_dir, "supervisor_started")) >= 2 and rollouts_done(job_dir) >= 8, 300,
                 "the requeued job to resume and go on")
        # every engine of the resumed job up (one may be starting or restarting when the rollouts are)
        engines: list[int] = []
        wait_for(lambda: _each_engine_listening(job_dir, engines), 120, "every engine to listen",
                 interval_s=STATUS_POLL_S)
        stopped += engines
        freeze_during_rollout(job_dir, engines)
        preempt(job_id)
        wait_for(lambda: len(events(job_dir, "requeue")) >= 2, 300, "the second requeue")
        for pid in engines:
            if psutil.pid_exists(pid):
                os.kill(pid, signal.SIGCONT)
        wait_job_gone(job_id, timeout_s=600)
    finally:
        subprocess.run(["scancel", job_id], capture_output=True)
        for pid in stopped:
            if psutil.pid_exists(pid):
                os.kill(pid, signal.SIGCONT)
    state = status(job_dir)
    assert state["stop_reason"] == "completed" and state["requeues"] == 2, state
    assert len(events(job_dir, "save_now")) == 2
    log = (job_dir / "logs" / "trainer.log").read_text()
    assert "abandoned rollout" in log, "the second signal should abandon the rollout being generated"
    assert_same_run(uninterrupted, job_dir)


# A slow reward model makes each rollout take 1.3 s or more: 24 of them outlast the at most ~25 s a
# one-minute start can work (15 s of start-up, then 20 s of grace).
TIME_LIMITED = ("--num-rollout", "24", "--rollout-batch-size", "8", "--save-interval", "100",
                "--custom-rm-path", "tests.trainer.plugins.slow_toy_reward", "--time", "1",
                "--preempt-grace", "20", "--max-requeues", "8")


@pytest.fixture(scope="module")
def time_limited(devcluster, toy, tmp_path_factory) -> Iterator[tuple[str, Path]]:
    """The job of test_time_limit_shorter_than_the_work_finishes_over_several_requeues (its id and job
    dir), submitted when first asked for: test_short_grace_saves_at_once asks for it so that it runs
    beside that test's job (most of its minutes are waits for its time limit and requeue holds)."""
    job_dir = tmp_path_factory.mktemp("time_limited") / "job"
    with background_job(toy, job_dir, *TIME_LIMITED) as job_id:
        yield job_id, job_dir


def test_time_limit_shorter_than_the_work_finishes_over_several_requeues(time_limited) -> None:
    """A one-minute job with more than a minute of work: before each time limit it saves and
    requeues itself (SLURM's warning signal, or the end time it read), until the work is done."""
    job_id, job_dir = time_limited
    wait_job_gone(job_id, timeout_s=900)
    state = status(job_dir)
    assert state["stop_reason"] == "completed" and state["requeues"] >= 1, state
    assert len(events(job_dir, "requeue")) == state["requeues"] == len(events(job_dir, "preemption"))
    assert not events(job_dir, "job_failed")
    rows = metrics(job_dir)
    assert [m["rollout_id"] for m in rows] == list(range(24)), "a rollout id was skipped or repeated"
    # A rollout generated before a requeue and trained after it is replayed from the journal, in no time.
    replayed = {r for resume in range(-1, len(resumed_at(job_dir))) for r in replayed_after(job_dir, resume)}
    fresh = [m["rollout_seconds"] for m in rows if m["rollout_id"] not in replayed]
    assert min(fresh) >= 1.28, "the slow reward should set the pace"
    assert_never_stale(job_dir)
