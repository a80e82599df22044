"""slime's --only-train-params-name-list / --freeze-params-name-list and --no-save-optim on the
megatron backend (one gloo process, a tiny Qwen3): the frozen parameters get no optimizer state and
do not move in a step, the others do; a checkpoint saved without the optimizer resumes the weights
and the loop state with a fresh optimizer. (Main refused the three flags.)"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from tests.rank_devices import start_ranks
from tests.rollout.servers import free_port
from tests.trainer.test_megatron_backend import _samples
from trainer.args import build_config, build_parser
from trainer.losses import LossConfig
from trainer.rl_step import make_pack_loss


def _backend(model: Path, *flags: str):
    from trainer.megatron.backend import MegatronBackend  # imports megatron: only in the worker

    args = build_config(build_parser().parse_args([
        "--hf-checkpoint", str(model), "--num-rollout", "1", "--n-samples-per-prompt", "2", "--debug-train-only",
        "--load-debug-rollout-data", "unused/{rollout_id}", "--lr", "1e-2", "--adam-eps", "1", *flags]))
    return MegatronBackend(args, json.loads((model / "config.json").read_text()))


def _worker(rank: int, port: int, model: Path, ckpt: Path, out: Path) -> None:
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from megatron.core import parallel_state

    from trainer import checkpoint, dist_env

    dist_env.init_process_group()
    backend = _backend(model, "--only-train-params-name-list", r"decoder\.layers\.0\.", "--freeze-params-name-list",
                       "layernorm", "--no-save-optim")
    backend.load(ckpt, weights_only=True)
    before = {n: p.detach().clone() for n, p in backend.model.named_parameters()}
    samples = _samples(backend.shape.vocab_size)
    ids = list(range(len(samples)))
    for i, s in enumerate(samples):
        s.old_log_probs = backend.log_probs(samples, ids)[i][0]
    backend.train_step(samples, ids, make_pack_loss(LossConfig(), samples, ids), need_entropy=False)
    moved = sorted(n for n, p in backend.model.named_parameters() if not torch.equal(p, before[n]))
    trainable = sorted(n for n, p in backend.model.named_parameters() if p.requires_grad)
    checkpoint.save(out / "save", 1, lambda tmp: backend.save(tmp, {"rollout_id": 1}))
    weights = {n: p.detach().clone() for n, p in backend.model.named_parameters()}

    parallel_state.destroy_model_parallel()  # a second backend in this process: megatron's groups afresh
    resumed = _backend(model)
    common = resumed.load(checkpoint.find_loadable(out / "save"), weights_only=False)
    same = all(torch.equal(p, weights[n]) for n, p in resumed.model.named_parameters())
    fresh = not any(resumed.actor.optimizer.optimizer.state.values())
    masters = all(torch.equal(m, p.float()) for m, p in zip(resumed.actor.optimizer.masters,
                                                             resumed.actor.optimizer.owned))
    torch.save({"moved": moved, "trainable": trainable, "common": common, "same": same, "fresh": fresh,
                "masters": masters}, out / "result.pt")
    dist_env.shutdown()


def test_frozen_parameters_stay_and_no_save_optim_resumes_with_a_fresh_optimizer(tiny_megatron,
                                                                                 tmp_path: Path) -> None:
    model, ckpt = tiny_megatron
    start_ranks(_worker, (free_port(), model, ckpt, tmp_path), 1)
    result = torch.load(tmp_path / "result.pt")
    assert result["trainable"] and all(n.startswith("decoder.layers.0.") and "layernorm" not in n
                                       for n in result["trainable"])
    assert result["moved"] == result["trainable"]  # every trainable one moved, no frozen one did
    assert result["common"] == {"rollout_id": 1}
    assert result["same"] and result["fresh"] and result["masters"]
