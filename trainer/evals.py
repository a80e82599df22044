"""When the trainer evaluates, and the eval a checkpoint owes.

slime's schedule: after every --eval-interval-th rollout (rollout_id + 1 a multiple of it), once
the engines serve the weights trained on it; also before the first rollout of a fresh start
(unless --skip-eval-before-train), reported in rollout 0's line as before_train/eval/... An eval
that falls due while the engines are a version behind (a save-now skipped the publish, or a
colocated trainer saved before publishing) is owed in the checkpoint: the resumed trainer runs it
after its first publish and adds it to that rollout's line, so a resumed run reports what an
uninterrupted one does.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from contract.job_dir import Metric, Phase
from rollout.buffer import DataBuffer
from rollout.eval import Evaluator
from trainer.rollout_source import Heartbeat

EVAL_OWED_KEY = "eval_owed"  # in the trainer state of a checkpoint (common.pt)
Amend = Callable[[int, dict[str, Any]], None]  # add metrics to an earlier rollout's line


def eval_due(interval: int | None, rollout_id: int) -> bool:
    return interval is not None and (rollout_id + 1) % interval == 0


def before_train(metrics: dict[str, float]) -> dict[str, float]:
    return {f"before_train/{name}": value for name, value in metrics.items()}


class EvalSchedule:
    def __init__(self, interval: int | None, skip_before_train: bool, evaluator: Evaluator | None,
                 buffer: DataBuffer | None, heartbeat: Heartbeat, amend: Amend) -> None:
        """evaluator: rank 0's (None on other ranks, which only keep the schedule)."""
        self.interval = interval
        self.skip_before_train = skip_before_train
        self.evaluator = evaluator
        self.buffer = buffer
        self.heartbeat = heartbeat
        self.amend = amend
        self.owed: int | None = None  # the rollout whose eval the engines could not run yet
        self.before_train: dict[str, float] = {}  # reported in rollout 0's line

    def due(self, rollout_id: int) -> bool:
        return eval_due(self.interval, rollout_id)

    def evaluate(self, rollout_id: int) -> dict[str, float]:
        self.heartbeat(Phase.ROLLOUT, rollout_id)  # eval is generation, with the rollout's timeout
        assert self.evaluator is not None
        return self.evaluator.run(rollout_id, self.buffer)

    def start(self, resumed: bool) -> None:
        """After the first publish: the eval before training (fresh start), or the one owed."""
        if self.evaluator:
            if not resumed and not self.skip_before_train:
                self.before_train = before_train(self.evaluate(0))
            elif self.owed is not None:
                self.amend(self.owed, self.evaluate(self.owed))
        self.owed = None

    def after_publish(self, rollout_id: int, published: bool) -> dict[str, Any]:
        """The eval that falls due after rollout_id (owed if the engines did not get its weights)."""
        metrics: dict[str, Any] = {}
        if self.due(rollout_id):
            if not published:
                self.owed = rollout_id
            elif self.evaluator:
                began = time.monotonic()
                metrics.update(self.evaluate(rollout_id))
                metrics[Metric.EVAL_SECONDS] = time.monotonic() - began
        if rollout_id == 0:
            metrics.update(self.before_train)
        return metrics

    @contextmanager
    def owed_while_saving(self, rollout_id: int) -> Iterator[None]:
        """A checkpoint written before rollout_id's publish owes its eval, if one is due."""
        owed = self.owed
        if self.due(rollout_id):
            self.owed = rollout_id
        try:
            yield
        finally:
            self.owed = owed

    def state_dict(self) -> dict[str, Any]:
        return {EVAL_OWED_KEY: self.owed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.owed = state.get(EVAL_OWED_KEY)
