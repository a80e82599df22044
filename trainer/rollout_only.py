"""--debug-rollout-only: the engines and the rollouts of a run, with no model in the trainer.

As in slime, nothing is trained, saved or re-published: every rollout (and every eval) is
generated from --hf-checkpoint's weights and reported, and with --save-debug-rollout-data each
one is dumped, for --debug-train-only to replay. The weights are published once, as version 0
and straight from --hf-checkpoint's files, because engines serve only once they report the
trainer's version (and engines shared with an earlier run are brought back to those weights).
Only rank 0 works; other ranks end at once. Without checkpoints a restarted run begins again at
rollout 0 and regenerates the same rollouts.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from ckpt_tools.hf_checkpoint import IGNORED_SUFFIXES, HFCheckpoint
from contract.job_dir import Metric, Phase
from trainer import save_now
from trainer.config import TrainerConfig
from trainer.loop import Driver, before_train

log = logging.getLogger(__name__)


def hf_weights(hf_checkpoint: str) -> Iterator[tuple[str, torch.Tensor]]:
    checkpoint = HFCheckpoint(Path(hf_checkpoint))
    for name in checkpoint.weight_map:
        if not name.endswith(IGNORED_SUFFIXES):
            yield name, checkpoint.read([name])[0]


def run(config: TrainerConfig) -> None:
    if int(os.environ.get("RANK", "0")) != 0:
        log.info("--debug-rollout-only: rank 0 generates the rollouts; this rank has nothing to do")
        return
    driver, signal = Driver(config), save_now.install()
    driver.reporter.drop_from(0)  # a restart redoes every rollout
    assert driver.publisher is not None
    driver.reporter.heartbeat(Phase.PUBLISH, 0)
    result = driver.publisher.publish("0", driver.engines(), hf_weights(config.model.hf_checkpoint))
    if driver.supervisor:
        driver.supervisor.published(0, result.updated, result.fenced)
    first_eval = (before_train(driver.evaluate(0))
                  if driver.evaluator and not config.eval.skip_eval_before_train else {})
    for rollout_id in range(config.run.num_rollout):
        if signal.requested or (driver.supervisor and driver.supervisor.stop_requested(rollout_id)):
            log.info("stopping before rollout %d, as asked", rollout_id)
            break
        began = time.monotonic()
        samples = driver.generate_abandonable(rollout_id, signal)
        if samples is None:
            log.warning("abandoned rollout %d, as asked", rollout_id)
            break
        metrics = {"reward_mean": sum(s.reward for s in samples) / max(1, len(samples)), "samples": len(samples),
                   Metric.ROLLOUT_SECONDS: time.monotonic() - began, "weight_version": 0}
        if config.eval.due(rollout_id):
            metrics.update(driver.evaluate(rollout_id))
        if rollout_id == 0:
            metrics.update(first_eval)
        driver.reporter.rollout(rollout_id, metrics)
    driver.reporter.close()
