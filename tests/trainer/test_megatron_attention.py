"""SDPAttention (trainer.megatron.attention) computes what megatron's local attention computes.

Both specs load the same weights (a tiny random Qwen3: 2 layers, hidden 64, 4 heads, 2 query
groups, qk-layernorm, fp32) from one torch_dist checkpoint; the local spec with an explicit causal
mask is the reference. Packed rows (thd, PackedSeqParams) must give each sequence the logits it
gets alone; TP=2 runs in two spawned gloo processes.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from megatron.core.packed_seq_params import PackedSeqParams

from ckpt_tools.convert import hf_to_torch_dist
from ckpt_tools.megatron_model import (
    build_gpt_model,
    destroy_parallel,
    init_parallel,
    load_torch_dist,
)
from tests.ckpt_tools.tiny_hf import make_tiny_hf
from tests.rank_devices import init_rank, rank_devices, start_ranks
from trainer.args import ArgsError
from trainer.megatron.attention import gpt_layer_spec
from trainer.numerics import attention_kernels, check_attention_backend

ATOL = 1e-5  # float32 throughout; only the order of sums differs
LENGTHS = (5, 11, 8)  # one packed row of three samples
_gen = torch.Generator().manual_seed(0)
BATCH = torch.randint(0, 128, (2, 12), generator=_gen)
SAMPLES = [torch.randint(0, 128, (n,), generator=_gen) for n in LENGTHS]


def _causal(seq: int) -> torch.Tensor:
    return torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)[None, None]  # True = masked


def _model(hf_config: dict, ckpt_dir: Path, attention: str, tp: int = 1) -> torch.nn.Module:
    spec = gpt_layer_spec(num_experts=None, qk_layernorm=True, attention=attention)
    model = build_gpt_model(hf_config, tp=tp, spec=spec)
    load_torch_dist(model, ckpt_dir)
    return model.eval()


@torch.no_grad()
def _logits(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
            position_ids: torch.Tensor | None = None, packed: PackedSeqParams | None = None) -> torch.Tensor:
    """On the model's device (the GPU where there is one); the logits come back on the CPU."""
    if position_ids is None:
        position_ids = torch.arange(input_ids.shape[1]).expand_as(input_ids)
    device = next(model.parameters()).device
    if packed is not None:
        packed = dataclasses.replace(packed, cu_seqlens_q=packed.cu_seqlens_q.to(device),
                                     cu_seqlens_kv=packed.cu_seqlens_kv.to(device))
    mask = None if attention_mask is None else attention_mask.to(device)
    return model(input_ids.to(device), position_ids.to(device), mask, packed_seq_params=packed,
                 runtime_gather_output=True).cpu()


def _pack(samples: list[torch.Tensor], lengths: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor, PackedSeqParams]:
    """input_ids [1, T], position_ids [1, T] restarting per sample, and the thd params for `lengths`."""
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lengths).cumsum(0)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))
    positions = torch.cat([torch.arange(n) for n in lengths])
    return torch.cat(samples)[None], positions[None], params


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape
    return (a - b).abs().max().item()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[dict, Path]:
    root = tmp_path_factory.mktemp("sdpa")
    hf_dir = make_tiny_hf("qwen3", root / "hf", tied=False)
    ckpt_dir = hf_to_torch_dist(hf_dir, root / "converted", make_vocab_size_divisible_by=128, progress=False)
    return json.loads((hf_dir / "config.json").read_text()), ckpt_dir


@pytest.fixture(scope="module")
def models(checkpoint):
    init_parallel(tp=1)
    yield _model(*checkpoint, "local"), _model(*checkpoint, "sdpa")
    destroy_parallel()


@pytest.fixture(scope="module")
def alone(models) -> list[torch.Tensor]:
    """Reference: each sample run alone through the local spec, [n, V] each."""
    local, _ = models
    return [_logits(local, s[None], _causal(len(s)))[0] for s in SAMPLES]


def test_unpacked_matches_local(models) -> None:
    local, sdpa = models
    reference = _logits(local, BATCH, _causal(BATCH.shape[1]))
    assert _max_diff(_logits(sdpa, BATCH, None), reference) <= ATOL  # is_causal path
    assert _max_diff(_logits(sdpa, BATCH, _causal(BATCH.shape[1])), reference) <= ATOL  # explicit mask
    # The tolerance discriminates: attention that sees the future is far off.
    no_mask = torch.zeros_like(_causal(BATCH.shape[1]))
    assert _max_diff(_logits(sdpa, BATCH, no_mask), reference) > 100 * ATOL


def test_packed_matches_each_sample_alone(models, alone) -> None:
    _, sdpa = models
    ids, positions, params = _pack(SAMPLES, LENGTHS)
    pieces = _logits(sdpa, ids, None, positions, params)[0].split(LENGTHS)
    for got, want in zip(pieces, alone):
        assert _max_diff(got, want) <= ATOL
    # The tolerance discriminates: one sequence over the whole row mixes samples across boundaries.
    mixed = _logits(sdpa, ids, None, positions, _pack(SAMPLES, (sum(LENGTHS),))[2])[0].split(LENGTHS)
    assert _max_diff(mixed[1], alone[1]) > 100 * ATOL


def test_the_packed_attention_has_no_flash_kernel_on_cpu(models) -> None:
    """--attention-backend flash limits SDPA to its flash kernel, which the packed rows' per-sequence
    calls do not get on CPU: a CPU trainer crashed at its first step. The rule the backend and
    submission both check (trainer/config/device_checks.py) refuses it; auto runs."""
    _, sdpa = models
    if next(sdpa.parameters()).is_cuda:
        pytest.skip("the CPU path")
    ids, positions, params = _pack(SAMPLES, LENGTHS)
    with attention_kernels("flash"), pytest.raises(RuntimeError, match="No available kernel"):
        _logits(sdpa, ids, None, positions, params)
    with attention_kernels("auto"):
        _logits(sdpa, ids, None, positions, params)
    with pytest.raises(ArgsError, match="--attention-backend flash: this trainer runs on CPU"):
        check_attention_backend("flash", torch.device("cpu"), "megatron")
    check_attention_backend("flash", torch.device("cpu"), "fsdp")  # HF's 4-D calls take torch's CPU flash kernel


def _tp_worker(rank: int, init_file: str, hf_config: dict, ckpt_dir: Path, out_dir: Path) -> None:
    init_rank(rank, 2, init_file)
    init_parallel(tp=2)
    model = _model(hf_config, ckpt_dir, "sdpa", tp=2)
    ids, positions, params = _pack(SAMPLES, LENGTHS)
    torch.save({"unpacked": _logits(model, BATCH, None), "packed": _logits(model, ids, None, positions, params)[0]},
               out_dir / f"logits_{rank}.pt")
    destroy_parallel()


def test_tensor_parallel_matches_local(checkpoint, models, alone, tmp_path: Path) -> None:
    """TP=2: each rank holds 2 of the 4 heads and 1 of the 2 query groups."""
    local, _ = models
    with rank_devices(2):
        start_ranks(_tp_worker, (str(tmp_path / "rendezvous"), *checkpoint, tmp_path), 2)
    reference = _logits(local, BATCH, _causal(BATCH.shape[1]))
    for rank in range(2):
        got = torch.load(tmp_path / f"logits_{rank}.pt")
        # TP=2 pads the vocabulary to a multiple of 256: compare the real (HF) vocabulary only.
        vocab = checkpoint[0]["vocab_size"]
        assert _max_diff(got["unpacked"][..., :vocab], reference[..., :vocab]) <= ATOL
        for piece, want in zip(got["packed"].split(LENGTHS), alone):
            assert _max_diff(piece[..., :vocab], want[..., :vocab]) <= ATOL
