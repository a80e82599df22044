"""--debug-rollout-only: the engines and the rollouts of a run, with no model in the trainer.

As in slime, nothing is trained, saved or re-published: every rollout (and every eval) is
generated from --hf-checkpoint's weights and reported, and with --save-debug-rollout-data each
one is dumped, for --debug-train-only to replay. The weights are published once, as version 0
and straight from --hf-checkpoint's files, because engines serve only once they report the
trainer's version (and engines shared with an earlier run are brought back to those weights).
Only rank 0 works; other ranks end at once. Without checkpoints a restarted run begins again at
rollout 0 and regenerates the same rollouts. Built by trainer.loop_builder.build_rollout_only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from ckpt_tools.hf_checkpoint import IGNORED_SUFFIXES, HFCheckpoint
from contract.job_dir import Metric, Phase
from trainer.evals import before_train
from trainer.rank0_parts import Rank0Parts
from trainer.save_now import SaveNowSignal

log = logging.getLogger(__name__)


def hf_weights(hf_checkpoint: Path) -> Iterator[tuple[str, torch.Tensor]]:
    checkpoint = HFCheckpoint(hf_checkpoint)
    for name in checkpoint.weight_map:
        if not name.endswith(IGNORED_SUFFIXES):
            yield name, checkpoint.read([name])[0]


class RolloutOnly:
    def __init__(self, parts: Rank0Parts, signal: SaveNowSignal, num_rollout: int, hf_checkpoint: Path) -> None:
        self.parts = parts
        self.signal = signal
        self.num_rollout = num_rollout
        self.hf_checkpoint = hf_checkpoint

    def run(self) -> None:
        parts, evals = self.parts, self.parts.evals
        supervisor = parts.fleet.supervisor
        parts.reporter.drop_from(0)  # a restart redoes every rollout
        assert parts.transport is not None
        parts.reporter.heartbeat(Phase.PUBLISH, 0)
        result = parts.transport.publish(0, parts.fleet.engines(), hf_weights(self.hf_checkpoint))
        if supervisor:
            supervisor.published(0, result.updated, result.dropped)
        first_eval = before_train(evals.evaluate(0)) if evals.evaluator and not evals.skip_before_train else {}
        for rollout_id in range(self.num_rollout):
            if self.signal.requested or (supervisor and supervisor.stop_requested(rollout_id)):
                log.info("stopping before rollout %d, as asked", rollout_id)
                break
            began = time.monotonic()
            groups = parts.generator.generate_abandonable(rollout_id)
            if groups is None:
                log.warning("abandoned rollout %d, as asked", rollout_id)
                break
            samples = [s for group in groups for s in group]
            metrics = {"reward_mean": sum(s.reward for s in samples) / max(1, len(samples)), "samples": len(samples),
                       Metric.ROLLOUT_SECONDS: time.monotonic() - began, "weight_version": 0,
                       **parts.generator.metrics}
            if evals.due(rollout_id):
                metrics.update(evals.evaluate(rollout_id))
            if rollout_id == 0:
                metrics.update(first_eval)
            parts.reporter.rollout(rollout_id, metrics)
        parts.reporter.close()
