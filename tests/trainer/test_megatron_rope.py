"""The packed-row RoPE (trainer/megatron/rope.py) is megatron's own thd rotation, without its
per-sample loop: the same numbers for the same packed row, and the table comes out per token only
while positions are set. Through the trainer, a sample deep in a packed row has the log-probs it
has alone (tests/trainer/test_megatron_backend.py)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_thd
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

from ckpt_tools import megatron_compat
from ckpt_tools.convert import hf_to_torch_dist
from rollout.tiny_model import write_tiny_model
from tests.rollout.servers import free_port
from trainer.megatron import rope as megatron_rope

megatron_compat.apply()  # megatron's rotary table asks for the CUDA device: on a CPU torch, the CPU

LENGTHS = [5, 1, 9, 3]
# float32 noise between two forwards of one sample in other company (the packed row's other GEMM
# shapes): 1 ulp of a log-prob near -4 (4.8e-7) here. Rotated by its offset in the row instead, a
# sample 4,000 tokens in was 6.2e-6 off.
PACKED_ALIKE = 2e-6


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
    got = megatron_rope._apply_rotary_pos_emb(t, table[_positions().to(table.device)], config, cu_seqlens=cu,
                                              cp_group=one_rank_group)
    assert torch.equal(got, want)
    assert not torch.equal(got, t), "the rotation must move the row to be a test"


def test_the_table_is_per_token_only_while_positions_are_set() -> None:
    """...for a thd row (its table as long as the longest sample) and for an unfused one (as long as
    the row: without, its samples would be rotated by their offsets in the row)."""
    rope = RotaryEmbedding(kv_channels=16, rotary_percent=1.0, rotary_base=10000, use_cpu_initialization=True)
    model = SimpleNamespace(rotary_pos_emb=rope)
    packed = megatron_rope.PackedRope(model)
    whole = model.rotary_pos_emb(sum(LENGTHS))
    packed.positions = _positions().to(whole.device)
    assert torch.equal(model.rotary_pos_emb(max(LENGTHS), packed_seq=True), whole[packed.positions])
    assert torch.equal(model.rotary_pos_emb(sum(LENGTHS)), whole[packed.positions])
    packed.positions = None
    assert torch.equal(model.rotary_pos_emb(sum(LENGTHS)), whole)
    assert torch.equal(model.rotary_pos_emb(max(LENGTHS), packed_seq=True), whole[:max(LENGTHS)])


def _deep_in_a_pack(rank: int, model_dir: str, out: str) -> None:
    """One trainer rank, on the CPU: a sample's log-probs alone and behind 4,000 tokens of other
    samples in one unfused packed row."""
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(free_port()), CUDA_VISIBLE_DEVICES="")
    from trainer.args import build_config, build_parser
    from trainer.batch import TrainSample
    from trainer.megatron.backend import MegatronBackend

    model = Path(model_dir)
    args = build_config(build_parser().parse_args([
        "--hf-checkpoint", model_dir, "--num-rollout", "1", "--n-samples-per-prompt", "2", "--debug-train-only",
        "--load-debug-rollout-data", "x", "--attention-backend", "local", "--use-dynamic-batch-size",
        "--max-tokens-per-gpu", "8192"]))
    backend = MegatronBackend(args, json.loads((model / "config.json").read_text()))
    backend.load(hf_to_torch_dist(model, Path(out) / "td", iteration=None, progress=False), weights_only=True)
    g = torch.Generator().manual_seed(0)

    def sample(length: int, response: int) -> TrainSample:
        return TrainSample(tokens=torch.randint(0, 105, (length,), generator=g), response_length=response,
                           loss_mask=torch.ones(response), reward=0.0, group_index=0)

    target = sample(12, 6)
    packed = [sample(500, 10) for _ in range(8)] + [target]
    alone = backend.log_probs([target], [0])[0][0]
    deep = backend.log_probs(packed, list(range(len(packed))))[len(packed) - 1][0]
    torch.save({"alone": alone, "deep": deep}, Path(out) / "logps.pt")


def test_a_sample_deep_in_a_packed_row_has_its_log_probs_alone(tmp_path: Path) -> None:
    model = write_tiny_model(tmp_path / "model")
    mp.start_processes(_deep_in_a_pack, args=(str(model), str(tmp_path)), nprocs=1, start_method="spawn")
    got = torch.load(tmp_path / "logps.pt")
    assert (got["deep"] - got["alone"]).abs().max() < PACKED_ALIKE, (got["deep"] - got["alone"]).abs().max()
