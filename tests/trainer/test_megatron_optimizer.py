"""The megatron backend's optimizer (trainer.megatron.optimizer) in two gloo processes (DP=2) on
a tiny Qwen3: the distributed optimizer keeps each parameter's state on one data-parallel rank
only, and a checkpoint (save, then load in fresh processes) resumes exactly: one more step equals
the uninterrupted run's, with Adam at the same layout and with SGD (momentum) at DP=1; and with bf16
weights (--bf16), whose fp32 masters the checkpoint keeps (resuming from the rounded weights would
not be exact)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from tests.rank_devices import rank_devices, start_ranks
from tests.rollout.servers import free_port
from tests.trainer.test_megatron_backend import ATOL, _samples
from trainer.args import build_config, build_parser
from trainer.losses import LossConfig
from trainer.rl_step import make_pack_loss


def _step(backend) -> dict[str, float]:
    samples = _samples(backend.shape.vocab_size)
    ids = list(range(len(samples)))
    logps = backend.log_probs(samples, ids)
    for i, s in enumerate(samples):
        s.old_log_probs = logps[i][0] + (0.3 if i % 2 else -0.3)
    return backend.train_step(samples, ids, make_pack_loss(LossConfig(), samples, ids), need_entropy=False)


def _worker(rank: int, world: int, port: int, phase: str, extra: list[str], model: Path, ckpt: Path,
            out: Path) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    from trainer import checkpoint, dist_env
    from trainer.megatron.backend import MegatronBackend

    args = build_parser().parse_args([
        "--hf-checkpoint", str(model), "--num-rollout", "1", "--n-samples-per-prompt", "2", "--debug-train-only", "--load-debug-rollout-data",
        "unused/{rollout_id}", "--lr", "1e-2", "--use-dynamic-batch-size", "--max-tokens-per-gpu", "24",
        # constant: the linear decay of a one-rollout run would leave the resumed step a zero LR
        "--lr-decay-style", "constant", *extra])
    args = build_config(args)
    backend = MegatronBackend(args, json.loads((model / "config.json").read_text()))
    result: dict = {}
    if phase == "uninterrupted":
        backend.load(ckpt, weights_only=True)
        _step(backend)
        checkpoint.save(out / "save", 1, lambda tmp: backend.save(tmp, {"rollout_id": 1}))
        optimizer = backend.actor.optimizer
        state = optimizer.optimizer.state
        result["owned"] = [len(optimizer.owned), len(optimizer.params)]
        result["param_numel"] = sum(p.numel() for p in optimizer.params)
        result["state_devices"] = sorted({t.device.type for s in state.values() for t in s.values() if t.dim() > 0})
        result["state_numel"] = sum(t.numel() for s in state.values() for t in s.values() if t.dim() > 0)
    else:
        assert backend.load(checkpoint.find_loadable(out / "save"), weights_only=False) == {"rollout_id": 1}
    result["metrics"] = _step(backend)
    result["weights"] = dict(backend.hf_weights())
    gathered = [None] * world
    torch.distributed.all_gather_object(gathered, result)
    if rank == 0:
        torch.save(gathered, out / f"{phase}.pt")
    dist_env.shutdown()


def _run(tiny_megatron: tuple[Path, Path], out: Path, phase: str, world: int, extra: list[str]) -> list[dict]:
    model, ckpt = tiny_megatron
    start_ranks(_worker, (world, free_port(), phase, extra, model, ckpt, out), world)
    return torch.load(out / f"{phase}.pt", map_location="cpu")


def _assert_same(resumed: dict, uninterrupted: dict, atol: float) -> None:
    for key in ("loss", "pg_loss", "grad_norm"):
        assert resumed["metrics"][key] == pytest.approx(uninterrupted["metrics"][key], abs=atol), key
    for name, tensor in uninterrupted["weights"].items():
        assert (resumed["weights"][name] - tensor).abs().max() <= atol, f"{name} after the resumed step"


@pytest.mark.parametrize("optimizer, resume_world, precision", [("adam", 2, "fp32"), ("sgd", 1, "fp32"), ("adam", 2, "bf16")])
def test_distributed_optimizer_resumes_exactly(tiny_megatron, tmp_path: Path, optimizer: str, resume_world: int,
                                               precision: str) -> None:
    extra = ["--optimizer", optimizer, "--use-distributed-optimizer", *(["--bf16"] if precision == "bf16" else [])]
    with rank_devices(2):
        before = _run(tiny_megatron, tmp_path, "uninterrupted", 2, extra)
    # Each rank owns part of the parameters and keeps state for those only, together all of them.
    owned = [r["owned"] for r in before]
    assert all(0 < mine < total for mine, total in owned) and sum(m for m, _ in owned) == owned[0][1]
    per_param = 2 if optimizer == "adam" else 1  # exp_avg and exp_avg_sq; momentum_buffer
    assert sum(r["state_numel"] for r in before) == per_param * before[0]["param_numel"]
    with rank_devices(2):
        resumed = _run(tiny_megatron, tmp_path, "resumed", resume_world, extra)
    _assert_same(resumed[0], before[0], 0.0 if resume_world == 2 else ATOL)
