"""TrainerWatch.check_stranded_engines: engines relaunched behind an update group's version (on no disk)
while none serves, and a trainer in its rollout waiting for them, get the trainer asked to save now and
end (its exit restarts it), once, after engine_stranded_timeout of that; cancelled if it is still in its
rollout SAVE_NOW_ANSWER_S later (the signal did not reach it), or has not ended within trainer_save_timeout.
In any other phase, or with the version on disk, nothing happens. (The whole job:
tests/integration/test_multinode_engine.py.)"""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from contract.job_dir import JobDir, Phase, write_heartbeat
from supervisor import trainer_watch
from supervisor.trainer_watch import TrainerWatch

VERSION = 4
STRANDED_S = 60.0  # engine_stranded_timeout
SAVE_S = 300.0  # trainer_save_timeout


class Watched:
    """A TrainerWatch over stand-ins for what the check reads (the engines' answer, the heartbeat, the
    trainer's step) and does (an event, the step's cancel), on a clock the test moves."""

    def __init__(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stranded: list[str],
                 signal_taken: bool = True) -> None:
        self.dir = JobDir(tmp_path)
        self.dir.root.mkdir(parents=True, exist_ok=True)
        self.now = 0.0
        monkeypatch.setattr(trainer_watch, "time", SimpleNamespace(monotonic=lambda: self.now, time=time.time))
        self.events: list[tuple[str, dict]] = []
        self.cancelled: list[object] = []
        self.signals: list[str] = []
        engines = SimpleNamespace(current=VERSION, stranded=lambda: stranded)
        job = SimpleNamespace(engines=engines, dir=self.dir, ft=SimpleNamespace(step_stop_timeout=1.0,
                                                                                step_term_grace=1.0,
                                                                                trainer_save_timeout=SAVE_S,
                                                                                engine_stranded_timeout=STRANDED_S),
                              events=SimpleNamespace(emit=lambda kind, step=None, **kw: self.events.append((kind, kw))))
        self.step = SimpleNamespace(returncode=None)
        launcher = SimpleNamespace(current=lambda name: self.step)
        steps = SimpleNamespace(cancel=lambda step, timeout_s, grace_s: self.cancelled.append(step))
        pool = SimpleNamespace(submit=lambda fn, *args: fn(*args))
        requeue = SimpleNamespace(signal_trainer=lambda name: self.signals.append(name) or signal_taken)
        self.watch = TrainerWatch(job, launcher, steps, requeue, None, pool, restarts=0)  # type: ignore[arg-type]

    def at(self, seconds: float, phase: Phase = Phase.ROLLOUT) -> None:
        self.now = seconds
        write_heartbeat(self.dir, phase, rollout_id=3)
        self.watch.check_stranded_engines()


def test_the_trainer_is_asked_once_to_save_and_end_after_the_engines_waited_stranded_s_in_its_rollout(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    w = Watched(tmp_path, monkeypatch, ["engine-0"])
    w.at(0.0)
    w.at(STRANDED_S - 1)
    assert not w.signals and not w.events
    w.at(STRANDED_S + 1)
    assert w.signals == ["USR1"] and not w.cancelled
    [(kind, said)] = w.events
    assert kind == "engines_stranded" and said["engines"] == ["engine-0"] and said["weight_version"] == VERSION
    w.at(STRANDED_S + SAVE_S, Phase.SAVE)
    assert w.signals == ["USR1"] and not w.cancelled, "saving, within its bound"
    w.at(STRANDED_S + SAVE_S + 2, Phase.SAVE)
    assert w.cancelled == [w.step] and w.signals == ["USR1"], "past trainer_save_timeout: cancelled, once"
    w.at(3 * STRANDED_S + SAVE_S)
    assert w.cancelled == [w.step] and len(w.events) == 1


def test_a_trainer_still_in_its_rollout_after_the_signal_is_cancelled(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    w = Watched(tmp_path, monkeypatch, ["engine-0"])
    w.at(0.0)
    w.at(STRANDED_S + 1)
    w.at(STRANDED_S + 1 + trainer_watch.SAVE_NOW_ANSWER_S - 1)
    assert w.signals == ["USR1"] and not w.cancelled, "within its bound to answer"
    w.at(STRANDED_S + 2 + trainer_watch.SAVE_NOW_ANSWER_S)
    assert w.cancelled == [w.step] and [kind for kind, _ in w.events] == ["engines_stranded", "save_now_unanswered"]
    w.at(STRANDED_S + SAVE_S * 2)
    assert w.cancelled == [w.step], "once"


def test_a_trainer_slurm_did_not_signal_is_cancelled_at_once(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    w = Watched(tmp_path, monkeypatch, ["engine-0"], signal_taken=False)
    w.at(0.0)
    w.at(STRANDED_S + 1)
    assert w.signals == ["USR1"] and w.cancelled == [w.step]


def test_the_wait_counts_from_when_the_trainer_is_back_in_a_rollout(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Training, the trainer publishes next: the engines get the version without a restart."""
    w = Watched(tmp_path, monkeypatch, ["engine-0"])
    w.at(0.0)
    w.at(STRANDED_S / 2, Phase.TRAIN)
    w.at(STRANDED_S + 1)
    w.at(2 * STRANDED_S)
    assert not w.signals
    w.at(2 * STRANDED_S + 2)
    assert w.signals == ["USR1"]


@pytest.mark.parametrize("case", ["none stranded", "version on disk", "trainer exited"])
def test_nothing_is_restarted_when_a_publish_is_not_what_the_engines_wait_for(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    w = Watched(tmp_path, monkeypatch, [] if case == "none stranded" else ["engine-0"])
    if case == "version on disk":  # the engines' recovery loads it from there
        w.dir.weights_of(VERSION).mkdir(parents=True)
    if case == "trainer exited":  # its exit is handled (on_exit) before anything else
        w.step.returncode = 1
    w.at(0.0)
    w.at(10 * STRANDED_S)
    assert not w.signals and not w.cancelled and not w.events
