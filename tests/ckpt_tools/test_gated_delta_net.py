"""Qwen3-Next's gated delta net over packed rows (ckpt_tools.gated_delta_net) computes transformers'
Qwen3NextGatedDeltaNet (and, its projections apart, Qwen3_5GatedDeltaNet) on each sequence alone: forward and
parameter gradients, sequences longer and shorter than the kernel's 64-token chunks, with no state crossing from
one sequence to the next."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import transformers
from megatron.core.transformer import TransformerConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

from ckpt_tools.gated_delta_net import LinearAttention, sequence_bounds
from ckpt_tools.gated_delta_rule import fla_kernel

SHAPE = dict(hidden_size=64, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
             linear_value_head_dim=8, linear_conv_kernel_dim=4)
LENGTHS = [70, 5, 130]  # over, under and over two chunks
ATOL = 1e-5  # float32; the chunked solves sum in another order than transformers'


def _pair(split: bool = False) -> tuple[Qwen3NextGatedDeltaNet, LinearAttention]:
    """transformers' module (Qwen3.5's where `split`) and ours with its weights."""
    torch.manual_seed(0)
    config_class, module = ((transformers.Qwen3_5TextConfig, Qwen3_5GatedDeltaNet) if split
                            else (transformers.Qwen3NextConfig, Qwen3NextGatedDeltaNet))
    hf_config = config_class(**SHAPE, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)
    hf = module(hf_config, layer_idx=0).float()
    with torch.no_grad():  # away from their initial values, so that a misread one shows
        hf.dt_bias.uniform_(-1, 1)
        hf.norm.weight.uniform_(0.5, 1.5)
    config = TransformerConfig(num_layers=1, num_attention_heads=4, layernorm_epsilon=1e-6,
                               use_cpu_initialization=True, **SHAPE)
    ours = LinearAttention(config, "torch", split)
    ours.load_state_dict(hf.state_dict())
    return hf, ours


@pytest.mark.parametrize("split", [False, True], ids=["qwen3_next", "qwen3_5"])
def test_packed_rows_are_transformers_sequences(split: bool) -> None:
    hf, ours = _pair(split)
    rows = [torch.randn(n, SHAPE["hidden_size"], generator=torch.Generator().manual_seed(n)) for n in LENGTHS]
    want = torch.cat([hf(row[None])[0] for row in rows])
    want.square().sum().backward()
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    got = ours(torch.cat(rows), cu)
    got.square().sum().backward()
    assert (got - want).abs().max() < ATOL * want.abs().max()
    mine = dict(ours.named_parameters())
    for name, theirs in hf.named_parameters():
        assert theirs.grad is not None and mine[name].grad is not None
        assert (mine[name].grad - theirs.grad).abs().max() < ATOL * theirs.grad.abs().max(), name


def test_no_state_crosses_from_one_sequence_to_the_next() -> None:
    _, ours = _pair()
    rows = torch.randn(sum(LENGTHS), SHAPE["hidden_size"], generator=torch.Generator().manual_seed(1))
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    changed = rows.clone()
    changed[: LENGTHS[0]] += 1.0  # the first sequence only
    with torch.no_grad():
        before, after = ours(rows, cu), ours(changed, cu)
    assert torch.equal(before[LENGTHS[0]:], after[LENGTHS[0]:])
    assert not torch.equal(before[: LENGTHS[0]], after[: LENGTHS[0]])
    with torch.no_grad():  # one sequence over the whole row: the later ones now see the first
        joined = ours(changed, torch.tensor([0, sum(LENGTHS)], dtype=torch.int32))
    assert not torch.equal(joined[LENGTHS[0]:], after[LENGTHS[0]:])


def test_sequence_bounds_read_the_local_attentions_block_mask() -> None:
    """The local attention packs samples into one row under a block-diagonal causal mask (True = masked)."""
    sample = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2])
    mask = torch.ones(9, 9, dtype=torch.bool).triu(1) | (sample[:, None] != sample[None, :])
    assert sequence_bounds(mask[None, None], batch=1, seq=9).tolist() == [0, 3, 5, 9]
    causal = torch.ones(4, 4, dtype=torch.bool).triu(1)[None, None]
    assert sequence_bounds(causal, batch=2, seq=4).tolist() == [0, 4, 8]
    assert sequence_bounds(None, batch=3, seq=2).tolist() == [0, 2, 4, 6]


@pytest.mark.skipif(importlib.util.find_spec("fla") is not None, reason="flash-linear-attention is installed here")
def test_the_fla_kernel_without_fla_names_the_flag_and_the_fix() -> None:
    with pytest.raises(ImportError, match=r"^--qwen-gdn-backend fla: flash-linear-attention is not importable here "
                                          r".*--qwen-gdn-backend torch"):
        fla_kernel()
