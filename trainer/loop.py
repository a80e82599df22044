"""The RL loop, composed of parts (built by trainer.loop_builder.build_loop). Every rank runs it;
rank 0 alone generates, publishes to the engines and reports.

    start: resume every part from --load's checkpoint (or load the initial weights), publish
           them, run the eval before training (or the one the checkpoint owes)
    for rollout_id from the resume point:
        stop here if asked (save-now, the supervisor): save and end
        rollout = source.rollout(rollout_id)        groups of samples, each with its weight version
        train_step.run(samples)                     log-probs, advantages, optimizer steps
        publish the trained weights as version v+1  (skipped by a save-now that came meanwhile; with
                                                    --update-weights-interval N only every N-th)
        eval when due, save when due, report the rollout's line

Each sample's staleness is the trainer's version minus the version that generated it: 0 here
(train.py), 1 and more when the source runs ahead of training (trainer.ahead_source). The source
is told before each publish and checkpoint (it settles what it generates) and before a stop.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from contract.job_dir import Metric, phase_times
from rollout.eval import pass_at_k
from trainer.backend import Backend
from trainer.checkpointer import ROLLOUT_ID_KEY, Checkpointer
from trainer.colocation import Colocation
from trainer.evals import EvalSchedule
from trainer.metrics import Reporter
from trainer.old_actor import OldActor
from trainer.phase_memory import PhaseMemory
from trainer.profiling import TrainProfiler
from trainer.publisher import Publisher
from trainer.rollout_source import Rollout, RolloutSource
from trainer.save_now import StopRequests
from trainer.train_step import TrainStep

log = logging.getLogger(__name__)

WEIGHT_VERSION_KEY = "weight_version"  # in the trainer state of a checkpoint (common.pt)
STALENESS_MEAN, STALENESS_MAX = "async/staleness_mean", "async/staleness_max"  # a rollout's samples'
TRAIN_WAIT = "perf/train_wait_time"  # slime's: since the last train step ended (perf/wait_time_ratio's numerator)


@dataclass
class Progress:
    """Where the loop is: the next rollout, and the weight version the trainer has (version v is
    trained on v rollouts; the engines serve it once published)."""
    next_rollout: int = 0
    weight_version: int = 0

    def trained(self, rollout_id: int) -> None:
        self.weight_version += 1
        self.next_rollout = rollout_id + 1

    def state_dict(self) -> dict[str, Any]:
        return {ROLLOUT_ID_KEY: self.next_rollout - 1, WEIGHT_VERSION_KEY: self.weight_version}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.next_rollout, self.weight_version = state[ROLLOUT_ID_KEY] + 1, state[WEIGHT_VERSION_KEY]


class Loop:
    def __init__(self, backend: Backend, progress: Progress, source: RolloutSource, train_step: TrainStep,
                 publisher: Publisher, checkpointer: Checkpointer, evals: EvalSchedule, stops: StopRequests,
                 colocation: Colocation | None, reporter: Reporter | None, profiler: TrainProfiler,
                 memory: PhaseMemory, num_rollout: int, log_passrate: bool, update_weights_interval: int = 1,
                 old_actor: OldActor | None = None) -> None:
        """reporter: rank 0's. memory: each phase's peak GPU memory (train_step measures log-probs
        and train with the same). log_passrate: report pass@k over the rollout's groups (--log-passrate).
        update_weights_interval: publish after every N-th rollout (--train-async's). old_actor
        (--keep-old-actor): told each version published."""
        self.backend = backend
        self.progress = progress
        self.source = source
        self.train_step = train_step
        self.publisher = publisher
        self.checkpointer = checkpointer
        self.evals = evals
        self.stops = stops
        self.colocation = colocation
        self.reporter = reporter
        self.profiler = profiler
        self.memory = memory
        self.num_rollout = num_rollout
        self.log_passrate = log_passrate
        self.update_weights_interval = update_weights_interval
        self.old_actor = old_actor
        self.published = 0  # the version the engines serve
        self._trained_at: float | None = None  # when the last train step ended (run() starts this clock)

    def start(self, initial_weights: Path | None, load_reference: Callable[[], None] | None) -> None:
        """Resume from --load if it holds a checkpoint, else start from `initial_weights` (None:
        the backend loaded them itself); then load the reference model, if there is one."""
        resumed = self.checkpointer.resume()
        if self.reporter:  # the rollouts from here on are done again (replayed or not): forget their earlier lines
            self.reporter.drop_from(self.progress.next_rollout)
        if resumed is not None:
            log.info("resumed from %s: next rollout %d, weight version %d", resumed, self.progress.next_rollout,
                     self.progress.weight_version)
        elif initial_weights is not None:
            self.backend.load(initial_weights, weights_only=True)
        if load_reference is not None:
            load_reference()
        self.publish()  # the engines serve exactly the trainer's weights from the first rollout on
        self.after_publish()
        self.evals.start(resumed=resumed is not None)

    def run(self) -> None:
        self._trained_at = time.monotonic()  # the trainer waits from here until its first train step
        for rollout_id in range(self.progress.next_rollout, self.num_rollout):
            if self.stops.before_rollout(rollout_id):
                log.info("stopping before rollout %d, as the supervisor asked", rollout_id)
                self.save_before_stop()
                break
            began = time.monotonic()
            with self.memory.phase("rollout"):
                rollout = self.source.rollout(rollout_id, self.progress.weight_version)
            if rollout is None:
                log.warning("abandoned rollout %d to save at once, as the supervisor asked", rollout_id)
                self.save_before_stop()
                break
            metrics = self.train(rollout, rollout_seconds=time.monotonic() - began)
            save_now = self.stops.after_train()
            if not self.finish(rollout_id, metrics, publish=not save_now):
                log.warning("saving after rollout %d without publishing it, as the supervisor asked", rollout_id)
                self.save_before_stop()
                break
        self.source.close()
        self.profiler.close()
        if self.reporter:
            self.reporter.close()

    def train(self, rollout: Rollout, rollout_seconds: float) -> dict[str, Any]:
        began, started_at = time.monotonic(), time.time()
        waited = began - (began if self._trained_at is None else self._trained_at)  # slime's train_wait
        samples = rollout.samples()
        if self.colocation:
            self.colocation.to_trainer()
        version = self.progress.weight_version
        for s in samples:
            s.staleness = version - (s.weight_version or 0)
        metrics = self.train_step.run(rollout.rollout_id, samples, version)
        metrics.update(rollout.metrics)
        train_seconds = time.monotonic() - began
        rewards = [s.reward if s.raw_reward is None else s.raw_reward for s in samples]  # as the rollout scored them
        metrics.update({"reward_mean": sum(rewards) / max(1, len(samples)), "samples": len(samples),
                        Metric.ROLLOUT_SECONDS: rollout_seconds, Metric.TRAIN_SECONDS: train_seconds,
                        STALENESS_MEAN: sum(s.staleness for s in samples) / max(1, len(samples)),
                        STALENESS_MAX: max((s.staleness for s in samples), default=0), TRAIN_WAIT: waited,
                        Metric.TRAIN_STARTED_AT: started_at, Metric.TRAIN_ENDED_AT: time.time()})
        metrics["tokens_per_s"] = sum(s.tokens.numel() for s in samples) / max(metrics[Metric.TRAIN_SECONDS], 1e-9)
        self._trained_at = time.monotonic()
        metrics[Metric.WAIT_TIME_RATIO] = waited / max(waited + train_seconds, 1e-9)
        if self.log_passrate:  # slime's passrate/pass@k over the rollout's groups
            passrate = pass_at_k(rewards, [s.group_index for s in samples])
            metrics.update({f"passrate/{k}": v for k, v in passrate.items()})
        return metrics

    def finish(self, rollout_id: int, metrics: dict[str, Any], publish: bool) -> bool:
        """After training on rollout_id: publish (when due), eval, save, report. Not published
        (save-now): the resumed trainer publishes these weights first thing. Returns False when
        a save-now request stops the loop (it came during training, or while the source settled)."""
        metrics["weight_version"] = self.progress.weight_version  # the version that generated the rollout
        self.progress.trained(rollout_id)
        save_due = self.checkpointer.due(rollout_id)
        stopping = not publish
        due = (rollout_id + 1) % self.update_weights_interval == 0
        if not stopping and (due or save_due) and not self.source.settle(publishing=due):
            stopping = True  # a save-now came while the source settled what it generates
        due = due and not stopping
        if due and self.colocation:
            # Colocated, the trainer saves while it holds the GPUs, before it publishes; the eval
            # that follows is owed in that checkpoint, as after a save-now.
            if save_due:
                with self.evals.owed_while_saving(rollout_id), self.memory.phase("save"):
                    metrics[Metric.SAVE_SECONDS] = self.checkpointer.save(rollout_id)
                save_due = False
            self.colocation.before_publish()
        if due:
            with self.memory.phase("publish"):
                metrics.update(self.publish())
        metrics["published_version"] = self.published
        if due:
            self.after_publish()
        with self.memory.phase("eval"):
            evaluated = self.evals.after_publish(rollout_id, published=not stopping)
        if Metric.EVAL_SECONDS not in evaluated:
            self.memory.forget("eval")  # none was due: the figures would be of nothing
        metrics.update(evaluated)
        if save_due:
            if stopping:
                self.source.stop_generating()
            with self.memory.phase("save"):
                metrics[Metric.SAVE_SECONDS] = self.checkpointer.save(rollout_id)
        metrics.update(phase_times(metrics), **self.memory.take())
        if self.reporter:
            self.reporter.rollout(rollout_id, metrics)
        self.profiler.after_rollout(rollout_id)
        return not stopping

    def publish(self) -> dict[str, Any]:
        """The trainer's weights to every ready engine, as its current version."""
        version = self.progress.weight_version
        out = self.publisher.publish(version, self.progress.next_rollout, self.backend.hf_weights())
        self.published = version
        if self.old_actor:
            self.old_actor.published(version)
        return out

    def after_publish(self) -> None:
        """Colocated, the engines get all their memory back; then the supervisor hears which engines
        took the version (it admits them to the router: trainer/publisher.py), then the source."""
        if self.colocation:
            self.colocation.to_engines()
        self.publisher.report()
        self.source.published(self.progress.weight_version)

    def save_before_stop(self) -> None:
        """A checkpoint of the last finished rollout, unless it has one."""
        self.source.stop_generating()
        last_done = self.progress.next_rollout - 1
        if self.checkpointer.unsaved(last_done):
            if self.colocation:
                self.colocation.to_trainer()
            self.checkpointer.save(last_done)


def seed_everything(seed: int) -> None:
    import random

    import numpy

    random.seed(seed)
    numpy.random.seed(seed)
    torch.manual_seed(seed)
