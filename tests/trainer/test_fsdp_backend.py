"""The fsdp backend on CPU (FSDP2 over gloo) against plain Hugging Face runs of the same model."""

from __future__ import annotations

import math
import shutil
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import transformers
from safetensors.torch import load_file, save_file
from torch import Tensor

from rollout.tiny_model import write_tiny_model
from tests.ckpt_tools.tiny_hf import make_tiny_hf
from tests.rank_devices import start_ranks
from trainer.args import ArgsError, parse_args
from trainer.backend import NonFiniteGradient, PackLoss
from trainer.batch import Batching, Pack, TrainSample, rank_packs
from trainer.fsdp_backend import FSDPBackend
from trainer.old_actor import OldActor

ATOL = 1e-5  # float32 throughout; packing and sharding only reorder sums
MAX_TOKENS = 24  # small, so the five samples make packs of several samples each
PACKED = Batching(dynamic=True, max_tokens=MAX_TOKENS)
LR = 1e-2  # large, so one step moves the weights well beyond float noise
LENGTHS = [(9, 4), (6, 3), (11, 5), (5, 2), (8, 1)]  # (tokens, response tokens)


def _samples() -> list[TrainSample]:
    gen = torch.Generator().manual_seed(0)
    return [TrainSample(tokens=torch.randint(0, 100, (n,), generator=gen), response_length=r,
                        loss_mask=torch.ones(r), reward=0.0, group_index=k)
            for k, (n, r) in enumerate(LENGTHS)]


def _nll_loss(n_samples: int) -> PackLoss:
    """Mean over samples of each sample's mean negative log-prob, pre-scaled for summation."""
    def loss(pack: Pack, logps: list[Tensor], ents: list[Tensor] | None) -> tuple[Tensor, dict[str, Tensor]]:
        value = sum(-lp.mean() for lp in logps) / n_samples
        metrics = {"nll": value.detach()}
        if ents is not None:
            metrics["entropy"] = sum(e.mean() for e in ents).detach() / n_samples
        return value, metrics
    return loss


def _mean_nll(logps: dict[int, tuple[Tensor, Tensor | None]]) -> float:
    return sum(float(-lp.mean()) for lp, _ in logps.values()) / len(logps)


def _hf_model(model_dir: Path) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _hf_alone(model: transformers.PreTrainedModel, sample: TrainSample) -> tuple[Tensor, Tensor]:
    """Log-probs and entropies of the sample's response, the sample run alone through plain HF."""
    with torch.no_grad():
        logits = model(sample.tokens[None]).logits[0, sample.prompt_length - 1:-1]
    logp = torch.log_softmax(logits, -1)
    return logp.gather(-1, sample.tokens[sample.prompt_length:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


def _assert_close(actual: Tensor, expected: Tensor) -> None:
    assert actual.shape == expected.shape
    assert (actual - expected).abs().max().item() <= ATOL


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {"actor": write_tiny_model(root / "actor", seed=0), "ref": write_tiny_model(root / "ref", seed=1)}


@pytest.fixture(scope="module", autouse=True)
def lone_process_group(tmp_path_factory):
    init = tmp_path_factory.mktemp("pg") / "rendezvous"
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_log_probs_equal_each_sample_alone(models, attn: str) -> None:
    samples = _samples()
    assert any(len(p.sample_ids) > 1 for p in rank_packs(samples, list(range(5)), 1, 0, PACKED))
    backend = FSDPBackend(models["actor"], batching=PACKED, ref_checkpoint=models["ref"],
                          attn_implementation=attn)
    for name in ("actor", "ref"):
        got = backend.log_probs(samples, list(range(5)), model=name, with_entropy=True)
        assert sorted(got) == list(range(5))
        hf_model = _hf_model(models[name])
        for i, sample in enumerate(samples):
            logp, ent = _hf_alone(hf_model, sample)
            _assert_close(got[i][0], logp)
            _assert_close(got[i][1], ent)
    with pytest.raises(ValueError, match="'ref'"):
        backend.log_probs(samples, [0], model="critic")


def test_attention_backend_flash_runs_the_flash_kernel_and_fused_needs_cuda(models) -> None:
    samples, ids = _samples(), list(range(5))
    auto = FSDPBackend(models["actor"], batching=PACKED, attn_implementation="sdpa").log_probs(samples, ids)
    flash = FSDPBackend(models["actor"], batching=PACKED, attn_implementation="sdpa", attention_backend="flash")
    for i, (logp, _) in flash.log_probs(samples, ids).items():
        _assert_close(logp, auto[i][0])
    with pytest.raises(ArgsError, match="--attention-backend fused: SDPA's cuDNN and memory-efficient kernels run on CUDA"):
        FSDPBackend(models["actor"], attention_backend="fused")


def test_train_step_lowers_the_loss_and_changes_the_weights(models) -> None:
    samples, ids = _samples(), list(range(5))
    backend = FSDPBackend(models["actor"], lr=LR, batching=PACKED)
    before = backend.log_probs(samples, ids)
    weights_before = dict(backend.hf_weights())
    metrics = backend.train_step(samples, ids, _nll_loss(len(ids)), need_entropy=True)
    # The metrics are summed over packs: the pre-scaled pieces add up to the batch mean.
    assert metrics["nll"] == pytest.approx(_mean_nll(before), abs=ATOL)
    assert metrics["grad_norm"] > 0 and metrics["lr"] == LR and "entropy" in metrics
    assert _mean_nll(backend.log_probs(samples, ids)) < metrics["nll"] - 0.1
    moved = [(w - weights_before[k]).abs().max().item() for k, w in backend.hf_weights()]
    assert min(moved) > 1e-3  # every tensor took a step (Adam's first step is about lr each)


def test_keep_old_actor_swaps_a_published_versions_weights_in_and_back(models) -> None:
    """--keep-old-actor on the fsdp backend (FSDP2 shards): the log-probs of a sample generated by
    version 0 are version 0's after a step, and the live weights come back bit for bit."""
    samples, ids = _samples(), list(range(5))
    backend = FSDPBackend(models["actor"], lr=LR, batching=PACKED)
    old_actor = OldActor(backend, max_staleness=1)
    old_actor.published(0)
    before = backend.log_probs(samples, ids, with_entropy=True)
    backend.train_step(samples, ids, _nll_loss(len(ids)), need_entropy=False)
    after = backend.log_probs(samples, ids, with_entropy=True)
    for s in samples:
        s.weight_version = 0
    old = old_actor.log_probs(samples, ids, current=1)
    for i in ids:
        assert torch.equal(old[i][0], before[i][0]) and not torch.equal(old[i][0], after[i][0])
    again = backend.log_probs(samples, ids, with_entropy=True)
    assert all(torch.equal(again[i][0], after[i][0]) for i in ids), "the live weights came back"


def _scenario(backend: FSDPBackend) -> dict:
    """Two steps (the second on one sample, so one of two ranks has none), then log-probs and
    the weights."""
    samples, ids = _samples(), list(range(len(LENGTHS)))
    first = backend.train_step(samples, ids, _nll_loss(len(ids)), need_entropy=True)
    second = backend.train_step(samples, [2], _nll_loss(1), need_entropy=False)
    logps = backend.log_probs(samples, ids, with_entropy=True)
    return {"metrics": [first, second], "logps": logps, "weights": dict(backend.hf_weights())}


# Adam with eps 1 moves each weight about lr * g / (|g| + 1), nearly proportional to its
# gradient, and no clipping: the weights then show the gradient's scale (a sum over ranks, not a
# mean) and float-level noise, instead of Adam's first-step g / |g| blowing up the noise of
# near-zero gradient elements.
PARITY = {"lr": LR, "batching": PACKED, "adam_eps": 1.0, "clip_grad": 1e6}


def _parallel_worker(rank: int, world: int, init_file: str, model_dir: Path, out: Path) -> None:
    # A collective that one rank never joins fails after the timeout instead of hanging the test.
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    result = _scenario(FSDPBackend(model_dir, **{**PARITY, "batching": BALANCED}))
    assert rank == 0 or not result["weights"]  # hf_weights yields on rank 0 only
    torch.save(result, out / f"result_{rank}.pt")
    dist.destroy_process_group()


BALANCED = Batching(dynamic=True, max_tokens=MAX_TOKENS, balance=True)


def test_two_ranks_take_the_same_step_as_one(models, tmp_path: Path) -> None:
    """Two ranks with dynamic, balanced micro-batches against one rank with two samples per
    micro-batch: the same losses, gradients (through the weights) and log-probs."""
    start_ranks(_parallel_worker, (2, str(tmp_path / "rendezvous"), models["actor"], tmp_path), 2)
    alone = _scenario(FSDPBackend(models["actor"], **{**PARITY, "batching": Batching(micro_batch_size=2)}))
    for rank in range(2):
        result = torch.load(tmp_path / f"result_{rank}.pt")
        # Averaging gradients over ranks instead of summing would halve grad_norm.
        for got, want in zip(result["metrics"], alone["metrics"]):
            assert got.keys() == want.keys()
            for key in want:
                assert got[key] == pytest.approx(want[key], abs=ATOL), key
        for i, (logp, ent) in alone["logps"].items():
            _assert_close(result["logps"][i][0], logp)
            _assert_close(result["logps"][i][1], ent)
    weights = torch.load(tmp_path / "result_0.pt")["weights"]
    assert weights.keys() == alone["weights"].keys()
    for name, tensor in alone["weights"].items():
        _assert_close(weights[name], tensor)


@pytest.mark.parametrize("batching", [Batching(micro_batch_size=3), BALANCED])
def test_the_step_does_not_depend_on_the_micro_batches(models, batching: Batching) -> None:
    """One sample per micro-batch (slime's default) against other micro-batchings: the same loss,
    gradient norm and new weights."""
    samples, ids = _samples(), list(range(5))
    assert len(rank_packs(samples, ids, 1, 0, batching)) not in (1, 5)  # a different split from both ends
    steps = {}
    for name, how in (("alone", Batching()), ("other", batching)):
        backend = FSDPBackend(models["actor"], **{**PARITY, "batching": how})
        metrics = backend.train_step(samples, ids, _nll_loss(len(ids)), need_entropy=True)
        steps[name] = metrics, dict(backend.hf_weights())
    (alone, alone_weights), (other, other_weights) = steps["alone"], steps["other"]
    for key in ("nll", "entropy", "grad_norm"):
        assert other[key] == pytest.approx(alone[key], abs=ATOL), key
    for name, tensor in alone_weights.items():
        _assert_close(other_weights[name], tensor)


def _halving(step: int) -> float:
    return 0.5 ** step


def test_resume_takes_the_same_next_step(models, tmp_path: Path) -> None:
    samples, ids, loss = _samples(), list(range(5)), _nll_loss(5)
    first = FSDPBackend(models["actor"], lr=LR, batching=PACKED, lr_schedule=_halving)
    first.train_step(samples, ids, loss, need_entropy=False)
    after_save = first.log_probs(samples, ids)
    first.save(tmp_path, {"rollout_id": 7})
    draw = torch.rand(4)
    expected = first.train_step(samples, [0, 2, 4], loss, need_entropy=False)
    expected_weights = dict(first.hf_weights())

    torch.manual_seed(999)
    resumed = FSDPBackend(models["actor"], lr=LR, batching=PACKED, lr_schedule=_halving)
    assert resumed.load(tmp_path, weights_only=False) == {"rollout_id": 7}
    assert torch.equal(torch.rand(4), draw)  # RNG restored
    assert expected["lr"] == LR / 2  # the schedule's second step
    assert resumed.train_step(samples, [0, 2, 4], loss, need_entropy=False) == expected
    for name, tensor in resumed.hf_weights():
        assert torch.equal(tensor, expected_weights[name]), name

    # weights_only: the saved weights, a fresh optimizer (so the next step differs).
    weights_only = FSDPBackend(models["actor"], lr=LR, batching=PACKED, lr_schedule=_halving)
    assert weights_only.load(tmp_path, weights_only=True) == {}
    for i, (logp, _) in weights_only.log_probs(samples, ids).items():
        assert torch.equal(logp, after_save[i][0])
    fresh = weights_only.train_step(samples, [0, 2, 4], loss, need_entropy=False)
    assert fresh["nll"] == expected["nll"] and fresh["lr"] == LR
    assert dict(weights_only.hf_weights())["model.norm.weight"].ne(expected_weights["model.norm.weight"]).any()


def test_no_save_optim_resumes_the_weights_and_loop_with_a_fresh_optimizer(models, tmp_path: Path) -> None:
    """--no-save-optim: the checkpoint holds no optimizer state; a full load from it restores the
    weights, RNG, LR schedule and loop state, and starts the optimizer afresh (slime's --no-load-optim)."""
    samples, ids, loss = _samples(), list(range(5)), _nll_loss(5)
    first = FSDPBackend(models["actor"], lr=LR, batching=PACKED, lr_schedule=_halving, save_optimizer=False)
    first.train_step(samples, ids, loss, need_entropy=False)
    after_save = first.log_probs(samples, ids)
    first.save(tmp_path, {"rollout_id": 7})
    draw = torch.rand(4)
    assert not any(key.startswith("optim") for key in dcp.FileSystemReader(tmp_path).read_metadata().state_dict_metadata)

    torch.manual_seed(999)
    resumed = FSDPBackend(models["actor"], lr=LR, batching=PACKED, lr_schedule=_halving)
    assert resumed.load(tmp_path, weights_only=False) == {"rollout_id": 7}
    assert torch.equal(torch.rand(4), draw)  # RNG restored
    for i, (logp, _) in resumed.log_probs(samples, ids).items():
        assert torch.equal(logp, after_save[i][0])
    assert resumed.optimizer.state == {}  # no moments: the optimizer starts afresh
    assert resumed.train_step(samples, [0, 2, 4], loss, need_entropy=False)["lr"] == LR / 2  # the schedule goes on


def test_hf_weights_load_into_a_fresh_hf_model(models, tmp_path: Path) -> None:
    samples, ids = _samples(), list(range(5))
    backend = FSDPBackend(models["actor"], lr=LR, batching=PACKED)
    backend.train_step(samples, ids, _nll_loss(5), need_entropy=False)
    weights = dict(backend.hf_weights())
    # Tied embeddings: the checkpoint's names exactly, no lm_head.weight.
    assert weights.keys() == load_file(models["actor"] / "model.safetensors").keys()
    exported = tmp_path / "exported"
    exported.mkdir()
    shutil.copy(models["actor"] / "config.json", exported)
    save_file(weights, exported / "model.safetensors")
    hf_model = _hf_model(exported)
    for i, (logp, _) in backend.log_probs(samples, ids).items():
        _assert_close(_hf_alone(hf_model, samples[i])[0], logp)


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_hf_weights_keep_the_checkpoint_dtype_and_names(arch: str, tmp_path: Path) -> None:
    model_dir = make_tiny_hf(arch, tmp_path / "bf16", tied=False, dtype=torch.bfloat16)
    backend = FSDPBackend(model_dir)  # computes in fp32 on CPU
    saved = load_file(model_dir / "model.safetensors")
    weights = dict(backend.hf_weights())
    # Untied: lm_head.weight is its own tensor. MoE: transformers fuses the experts of a layer
    # into one tensor in memory; the checkpoint's per-expert tensors come back.
    assert weights.keys() == saved.keys()
    for name, tensor in weights.items():
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, saved[name]), name


def test_from_config_reads_the_trainer_flags(models, tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("")
    argv = ["--hf-checkpoint", str(models["actor"]), "--num-rollout", "1", "--n-samples-per-prompt", "2", "--prompt-data", str(prompts),
            "--engine-urls", "http://127.0.0.1:1", "--train-backend", "fsdp", "--use-kl-loss",
            "--lr", "0.5", "--lr-warmup-iters", "4", "--use-dynamic-batch-size", "--max-tokens-per-gpu", str(MAX_TOKENS),
            "--log-probs-max-tokens-per-gpu", "64", "--balance-data"]
    backend = FSDPBackend.from_config(parse_args(argv))
    samples = _samples()
    assert backend.batching == Batching(dynamic=True, max_tokens=MAX_TOKENS, balance=True)
    assert backend.log_probs_batching == Batching(dynamic=True, max_tokens=64, balance=True)
    # The KL reference is the starting checkpoint itself.
    ref, actor = backend.log_probs(samples, [0], "ref"), backend.log_probs(samples, [0])
    assert torch.equal(ref[0][0], actor[0][0])
    # Megatron's warmup: the first step's lr is 0, then it rises by --lr / --lr-warmup-iters a step
    assert [backend.train_step(samples, [0], _nll_loss(1), need_entropy=False)["lr"] for _ in range(2)] == [0.0, 0.5 / 4]
    with pytest.raises(ArgsError, match="--ref-load"):
        FSDPBackend.from_config(parse_args(argv + ["--ref-load", str(tmp_path)]))


def _nan_loss(pack: Pack, logps: list[Tensor], ents: list[Tensor] | None) -> tuple[Tensor, dict[str, Tensor]]:
    return sum(lp.sum() for lp in logps) * float("nan"), {}


@pytest.mark.parametrize("flags", [[], ["--no-check-for-nan-in-loss-and-grad"]])
def test_a_nan_gradient_stops_the_trainer_unless_the_check_is_off(models, tmp_path: Path, flags: list[str]) -> None:
    """megatron's check_for_nan_in_loss_and_grad (on by default) raises; off, the step is skipped as
    slime skips it: the weights and the LR schedule stay, grad_norm says nan, the next step goes on."""
    argv = ["--hf-checkpoint", str(models["actor"]), "--num-rollout", "1", "--n-samples-per-prompt", "2",
            "--debug-train-only", "--load-debug-rollout-data", "unused", "--train-backend", "fsdp", "--lr", "0.5",
            "--lr-warmup-iters", "4", *flags]
    backend, samples = FSDPBackend.from_config(parse_args(argv)), _samples()
    weights = dict(backend.hf_weights())
    if not flags:
        with pytest.raises(NonFiniteGradient, match="gradient norm is nan; the optimizer step was not taken"):
            backend.train_step(samples, [0], _nan_loss, need_entropy=False)
        return
    skipped = backend.train_step(samples, [0], _nan_loss, need_entropy=False)
    assert math.isnan(skipped["grad_norm"]) and skipped["lr"] == 0.0
    assert all(torch.equal(w, weights[k]) for k, w in backend.hf_weights()), "the NaN step reached the weights"
    taken = backend.train_step(samples, [0], _nll_loss(1), need_entropy=False)
    assert math.isfinite(taken["grad_norm"]) and taken["lr"] == 0.0, "the skipped step advanced the LR schedule"
    assert all(torch.isfinite(w).all() for _, w in backend.hf_weights())
