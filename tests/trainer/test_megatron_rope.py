"""The packed-row RoPE (trainer/megatron/rope.py) is megatron's own thd rotation, without its
per-sample loop: the same numbers for the same packed row, and the table comes out per token only
while positions are set."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_thd
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

from ckpt_tools import megatron_compat
from trainer.megatron import rope as megatron_rope

megatron_compat.apply()  # megatron's rotary table asks for the CUDA device: on a CPU torch, the CPU

LENGTHS = [5, 1, 9, 3]


@pytest.fixture()
def one_rank_group() -> Iterator[dist.ProcessGroup]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def _positions() -> torch.Tensor:
    return torch.cat([torch.arange(n) for n in LENGTHS])


def test_one_rotation_equals_megatrons_per_sample_rotation(one_rank_group) -> None:
    torch.manual_seed(0)
    rope = RotaryEmbedding(kv_channels=16, rotary_percent=1.0, rotary_base=10000, use_cpu_initialization=True)
    table = rope(max(LENGTHS), packed_seq=True)  # [max_s, 1, 1, d]
    t = torch.randn(sum(LENGTHS), 4, 16, device=table.device)  # the table is on the GPU where there is one
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    config = SimpleNamespace(apply_rope_fusion=False, rotary_interleaved=False, multi_latent_attention=False)
    want = _apply_rotary_pos_emb_thd(t, cu, table, cp_group=one_rank_group)
    got = megatron_rope._apply_rotary_pos_emb(t, table[_positions().to(table.device)], config, cu_seqlens=cu, cp_group=one_rank_group)
    assert torch.equal(got, want)
    assert not torch.equal(got, t), "the rotation must move the row to be a test"


def test_the_table_is_per_token_only_while_positions_are_set() -> None:
    rope = RotaryEmbedding(kv_channels=16, rotary_percent=1.0, rotary_base=10000, use_cpu_initialization=True)
    model = SimpleNamespace(rotary_pos_emb=rope)
    packed = megatron_rope.PackedRope(model)
    whole = model.rotary_pos_emb(max(LENGTHS), packed_seq=True)
    packed.positions = _positions().to(whole.device)
    assert torch.equal(model.rotary_pos_emb(max(LENGTHS), packed_seq=True), whole[packed.positions])
    assert torch.equal(model.rotary_pos_emb(max(LENGTHS)), whole), "an unpacked row keeps the table"
    packed.positions = None
    assert torch.equal(model.rotary_pos_emb(max(LENGTHS), packed_seq=True), whole)
