"""The megatron backend calls slime's hooks with slime's signatures (init(args) before any model,
before_log_prob(args, model_chunks, store_prefix), before_train_step(args, rollout_id, step_id,
model_chunks, optimizer, opt_param_scheduler)), and a NaN gradient stops the step before the
optimizer touches the weights (Megatron's check_for_nan_in_loss_and_grad), or with
--no-check-for-nan-in-loss-and-grad skips it, as slime does."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch

from ckpt_tools.convert import hf_to_torch_dist
from rollout.tiny_model import write_tiny_model
from tests.rank_devices import start_ranks
from tests.rollout.servers import free_port
from tests.trainer.megatron_hooks import HOOK_LOG_ENV
from tests.trainer.test_megatron_backend import _samples
from trainer.args import build_config, build_parser
from trainer.losses import LossConfig
from trainer.rl_step import make_pack_loss

HOOKS = "tests.trainer.megatron_hooks"


def _worker(rank: int, port: int, model: Path, ckpt: Path, out: Path) -> None:
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from trainer.backend import NonFiniteGradient
    from trainer.megatron.backend import MegatronBackend

    argv = [
        "--hf-checkpoint", str(model), "--num-rollout", "1", "--n-samples-per-prompt", "2", "--debug-train-only", "--load-debug-rollout-data",
        "unused/{rollout_id}", "--attention-backend", "local", "--lr", "1e-3",
        "--custom-megatron-init-path", f"{HOOKS}.init",
        "--custom-megatron-before-log-prob-hook-path", f"{HOOKS}.before_log_prob",
        "--custom-megatron-before-train-step-hook-path", f"{HOOKS}.before_train_step"]
    args = build_config(build_parser().parse_args(argv))
    backend = MegatronBackend(args, json.loads((model / "config.json").read_text()))
    backend.load(ckpt, weights_only=True)
    samples, result = _samples(backend.shape.vocab_size), {}
    ids = list(range(len(samples)))
    for i, logp in backend.log_probs(samples, ids).items():
        samples[i].old_log_probs = logp[0]
    backend.train_step(samples, ids, make_pack_loss(LossConfig(), samples, ids), need_entropy=False,
                       rollout_id=3, step_id=1)
    before = {name: t.clone() for name, t in backend.hf_weights()}

    def nan_loss(pack, logps, ents):
        return sum(lp.sum() for lp in logps) * float("nan"), {}

    try:
        backend.train_step(samples, ids, nan_loss, need_entropy=False, rollout_id=4, step_id=0)
    except NonFiniteGradient as err:
        result["error"] = str(err)
    after = dict(backend.hf_weights())
    result["unchanged"] = all(torch.equal(before[n], after[n]) for n in before)
    # --no-check-for-nan-in-loss-and-grad: the same step is skipped (slime's), and training goes on
    backend.config = build_config(build_parser().parse_args(argv + ["--no-check-for-nan-in-loss-and-grad"]))
    lr_step = backend.actor.scheduler.last_epoch
    result["skipped_grad_norm"] = backend.train_step(samples, ids, nan_loss, need_entropy=False, rollout_id=4,
                                                     step_id=1)["grad_norm"]
    result["skipped_unchanged"] = (all(torch.equal(before[n], w) for n, w in backend.hf_weights())
                                   and backend.actor.scheduler.last_epoch == lr_step)
    torch.save(result, out / "result.pt")
    from trainer import dist_env

    dist_env.shutdown()


def test_hooks_get_slimes_arguments_and_a_nan_gradient_stops_the_step(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    model = write_tiny_model(tmp_path / "model", seed=0)
    ckpt = hf_to_torch_dist(model, tmp_path / "torch_dist", iteration=None, progress=False)
    log = tmp_path / "hooks.jsonl"
    monkeypatch.setenv(HOOK_LOG_ENV, str(log))
    start_ranks(_worker, (free_port(), model, ckpt, tmp_path), 1)
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert calls[0] == {"hook": "init", "lr": 1e-3}
    assert calls[1] == {"hook": "log_prob", "chunks": ["GPTModel"], "store_prefix": ""}
    assert calls[2] == {"hook": "train_step", "rollout_id": 3, "step_id": 1, "chunks": ["GPTModel"], "lr": 1e-3,
                        "optimizer_steps": True}
    assert calls[3]["rollout_id"] == 4 and calls[4]["step_id"] == 1 and len(calls) == 5
    result = torch.load(tmp_path / "result.pt")
    assert "gradient norm is nan; the optimizer step was not taken" in result["error"]
    assert result["unchanged"], "a NaN step reached the weights"
    assert math.isnan(result["skipped_grad_norm"]), "--no-check-for-nan-in-loss-and-grad: the step is skipped"
    assert result["skipped_unchanged"], "a skipped NaN step reached the weights or the LR schedule"
