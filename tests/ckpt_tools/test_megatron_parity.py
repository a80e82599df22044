"""Megatron-core reproduces HF logits from a torch_dist checkpoint.

The checkpoint is the converter's output (ckpt_tools.convert, plain DCP, no megatron involved
in writing), read back at TP=1 in this process and at TP=2 (EP=2 for MoE) in two spawned
processes (one GPU each where there are two, else gloo on CPU).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
import transformers
from safetensors.torch import load_file

from ckpt_tools.architectures import (
    EXPERT_BIAS_ARCHITECTURES,
    MINIMAX_ARCHITECTURES,
    MOE_ARCHITECTURES,
    QWEN3_NEXT_ARCHITECTURES,
    dense_first_layers,
)
from ckpt_tools.convert import hf_to_torch_dist
from ckpt_tools.megatron_model import (
    build_gpt_model,
    destroy_parallel,
    init_parallel,
    load_torch_dist,
    megatron_logits,
    transformer_config_from_hf,
)
from ckpt_tools.torch_dist import read_metadata
from tests.ckpt_tools.tiny_hf import make_tiny_hf
from tests.rank_devices import init_rank, rank_devices

ATOL = 1e-5  # float32 end to end; TP only reorders sums
# Qwen3-Next: float32 rounding of the gated delta rule (chunked triangular solves, exponentials of cumulative
# decays): transformers' own float32 logits are 3.3e-5 from its float64 ones on such a model (40 tokens; a Qwen3's,
# ~1e-6); a misplaced tensor is off by far more (test_naive_qkv_layout_is_caught)
ARCH_ATOL = {"Qwen3NextForCausalLM": 1e-4}
CASES = {  # id: (arch, tied embeddings)
    "qwen3": ("qwen3", False),
    "qwen2": ("qwen2", False),
    "llama-tied": ("llama", True),
    "llama-untied": ("llama", False),
    "qwen3_moe": ("qwen3_moe", False),
    "deepseek_v3": ("deepseek_v3", False),
    "deepseek_v3_dense_first": ("deepseek_v3_dense_first", False),  # first_k_dense_replace 1 of 3 layers
    "glm4_moe": ("glm4_moe", False),  # first_k_dense_replace 1 of 3 layers, qkv bias, q/k norms, half RoPE
    "glm4_moe_lite": ("glm4_moe_lite", False),  # MLA, mlp_layer_types dense, sparse, sparse
    # GLM-4-0414: qkv bias, fused gate_up_proj, interleaved RoPE over half of each head, and the attention's
    # and the MLP's outputs normalised (GLM-4 without those norms: test_convert's round trip)
    "glm4": ("glm4", False),
    "minimax_m2": ("minimax_m2", False),  # q/k norms over all heads (summed over TP), expert-bias MoE, half RoPE
    # gated delta nets (packed or not: each row a sequence) then gated attention; gated shared expert; 1p norms
    "qwen3_next": ("qwen3_next", False),
}
INPUT_IDS = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))


@dataclass
class Case:
    hf_config: dict
    hf_state: dict[str, torch.Tensor]
    hf_logits: torch.Tensor
    ckpt_dir: Path


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, hf_config: dict) -> None:
    assert actual.shape == expected.shape
    diff = (actual - expected).abs().max().item()
    atol = ARCH_ATOL.get(hf_config["architectures"][0], ATOL)
    assert diff <= atol, f"max |megatron - HF| = {diff:.3g} > {atol}"


@pytest.fixture(scope="module")
def lone_process_group():
    init_parallel(tp=1, ep=1)
    yield
    destroy_parallel()


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory, lone_process_group) -> Case:
    arch, tied = CASES[request.param]
    root = tmp_path_factory.mktemp(request.param)
    hf_dir = make_tiny_hf(arch, root / "hf", tied=tied)
    hf_config = json.loads((hf_dir / "config.json").read_text())
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        hf_logits = hf_model(INPUT_IDS).logits
    hf_state = load_file(hf_dir / "model.safetensors")
    # What is checked is the converter's own output (plain DCP, no megatron involved in writing).
    ckpt_dir = hf_to_torch_dist(hf_dir, root / "converted", make_vocab_size_divisible_by=128, progress=False)
    return Case(hf_config, hf_state, hf_logits, ckpt_dir)


def test_tp1_load_matches_hf(case: Case) -> None:
    model = build_gpt_model(case.hf_config)
    load_torch_dist(model, case.ckpt_dir)
    _assert_close(megatron_logits(model, INPUT_IDS), case.hf_logits, case.hf_config)


def test_tied_untied_mismatch_is_reported(case: Case) -> None:
    """Strict both ways: output_layer.weight is either unused or missing."""
    flipped = {**case.hf_config, "tie_word_embeddings": not case.hf_config.get("tie_word_embeddings", False)}
    with pytest.raises(RuntimeError, match="output_layer.weight"):
        load_torch_dist(build_gpt_model(flipped), case.ckpt_dir)


def _parallel_worker(rank: int, world: int, init_file: str, tp: int, ep: int, hf_config: dict,
                     ckpt_dir: Path, out_dir: Path) -> None:
    init_rank(rank, world, init_file)
    init_parallel(tp, ep)
    model = build_gpt_model(hf_config, tp, ep)
    load_torch_dist(model, ckpt_dir)
    torch.save(megatron_logits(model, INPUT_IDS), out_dir / f"logits_{rank}.pt")
    destroy_parallel()


def test_parallel_load_matches_hf(case: Case, tmp_path: Path) -> None:
    # MoE with TP > 1 needs sequence parallel, which the torch norm refuses: split experts instead.
    tp, ep = (1, 2) if case.hf_config["architectures"][0] in MOE_ARCHITECTURES else (2, 1)
    # start_processes uses mp.get_context("spawn") and stops the other rank if one fails.
    with rank_devices(2):
        mp.start_processes(
            _parallel_worker, args=(2, str(tmp_path / "rendezvous"), tp, ep, case.hf_config, case.ckpt_dir, tmp_path),
            nprocs=2, start_method="spawn",
        )
    for rank in range(2):
        _assert_close(torch.load(tmp_path / f"logits_{rank}.pt"), case.hf_logits, case.hf_config)


def _tp2_sp_ep2_worker(rank: int, world: int, init_file: str, hf_config: dict, ckpt_dir: Path, out_dir: Path) -> None:
    from megatron.core.models.gpt import GPTModel

    from trainer.megatron.attention import gpt_block_spec

    init_rank(rank, world, init_file)
    init_parallel(tp=2, ep=2, etp=1)
    config, model_kwargs = transformer_config_from_hf(hf_config, tp=2, ep=2, etp=1, sequence_parallel=True)
    full_qk_norm = hf_config["architectures"][0] in MINIMAX_ARCHITECTURES
    model = GPTModel(config=config, transformer_layer_spec=gpt_block_spec(config, "local", full_qk_norm=full_qk_norm),
                     **model_kwargs)
    if torch.cuda.is_available():  # the torch norms are built on the CPU whatever the config says
        model = model.to(torch.device("cuda", torch.cuda.current_device()))
    model.hf_vocab_size = hf_config["vocab_size"]
    load_torch_dist(model, ckpt_dir)
    torch.save(megatron_logits(model, INPUT_IDS), out_dir / f"logits_{rank}.pt")
    destroy_parallel()


def test_tp2_sp_ep2_matches_hf(case: Case, tmp_path: Path) -> None:
    """With SP (which MoE under TP needs) and EP=2, in the trainer's layer spec (whose norms take SP): MiniMax-M2's
    q/k norms span the heads of both TP ranks; Qwen3-Next's gated delta nets run whole on each rank over the
    gathered sequence, its gated attention's query and gate split by head."""
    if case.hf_config["architectures"][0] not in (*MINIMAX_ARCHITECTURES, *QWEN3_NEXT_ARCHITECTURES):
        pytest.skip("MiniMax-M2 and Qwen3-Next only")
    with rank_devices(2):
        mp.start_processes(_tp2_sp_ep2_worker, args=(2, str(tmp_path / "rendezvous"), case.hf_config, case.ckpt_dir,
                                                      tmp_path), nprocs=2, start_method="spawn")
    for rank in range(2):
        _assert_close(torch.load(tmp_path / f"logits_{rank}.pt"), case.hf_logits, case.hf_config)


def test_full_qk_norms_are_keyed_as_slimes(case: Case) -> None:
    """slime's MiniMaxM2SelfAttention keeps its norms as q_norm and k_norm, full width (all heads); stacked over
    layers here."""
    if case.hf_config["architectures"][0] not in MINIMAX_ARCHITECTURES:
        pytest.skip("MiniMax-M2 only")
    stored = read_metadata(case.ckpt_dir).state_dict_metadata
    layers, width = case.hf_config["num_hidden_layers"], case.hf_config["head_dim"]
    for qk, heads in (("q", case.hf_config["num_attention_heads"]), ("k", case.hf_config["num_key_value_heads"])):
        assert list(stored[f"decoder.layers.self_attention.{qk}_norm.weight"].size) == [layers, heads * width]
    assert not any("layernorm" in key for key in stored if "self_attention" in key)


def test_naive_qkv_layout_is_caught(case: Case) -> None:
    """The tolerance discriminates: q|k|v concatenated without the per-KV-group interleave."""
    if "kv_lora_rank" in case.hf_config:
        pytest.skip("MLA has no fused q|k|v (test_mla_layout_and_routing_bias_are_checked covers it)")
    model = build_gpt_model(case.hf_config)
    load_torch_dist(model, case.ckpt_dir)
    with torch.no_grad():
        for i, layer in enumerate(model.decoder.layers):
            if hasattr(layer.self_attention, "linear_qkv"):  # not a gated delta net (Qwen3-Next)
                naive = torch.cat([case.hf_state[f"model.layers.{i}.self_attn.{p}_proj.weight"] for p in "qkv"])
                layer.self_attention.linear_qkv.weight.copy_(naive)
    assert (megatron_logits(model, INPUT_IDS) - case.hf_logits).abs().max().item() > 100 * ATOL


@pytest.mark.parametrize("wrong", ["v_before_k", "no_routing_bias", "dense_up_before_gate"])
def test_mla_layout_and_routing_bias_are_checked(case: Case, wrong: str) -> None:
    """The tolerance discriminates for DeepSeek-V3 and GLM-4.5: kv_b_proj's per-head [K | V] order
    (MLA), the expert bias that picks the experts (not their weights), and the [gate; up] order of
    the dense layers' MLP (first_k_dense_replace)."""
    if case.hf_config["architectures"][0] not in EXPERT_BIAS_ARCHITECTURES:
        pytest.skip("DeepSeek-V3 and GLM-4.5 (expert bias) only")
    if wrong == "v_before_k" and "kv_lora_rank" not in case.hf_config:
        pytest.skip("MLA only")
    if wrong.startswith("dense") and not dense_first_layers(case.hf_config):
        pytest.skip("dense first layers only")
    model = build_gpt_model(case.hf_config)
    load_torch_dist(model, case.ckpt_dir)
    with torch.no_grad():
        for layer in model.decoder.layers:
            dense = not hasattr(layer.mlp, "router")
            if wrong == "v_before_k":
                nope, v = case.hf_config["qk_nope_head_dim"], case.hf_config["v_head_dim"]
                up = layer.self_attention.linear_kv_up_proj.weight
                k, val = up.view(-1, nope + v, up.shape[-1]).split([nope, v], dim=1)
                up.copy_(torch.cat([val, k], dim=1).reshape(up.shape))
            elif wrong == "no_routing_bias" and not dense:
                layer.mlp.router.expert_bias.zero_()
            elif wrong == "dense_up_before_gate" and dense:
                fc1 = layer.mlp.linear_fc1.weight
                fc1.copy_(torch.cat(fc1.chunk(2)[::-1]))
    assert (megatron_logits(model, INPUT_IDS) - case.hf_logits).abs().max().item() > 100 * ATOL


def test_unsupported_architecture_is_named() -> None:
    with pytest.raises(ValueError, match="MistralForCausalLM.*LlamaForCausalLM"):
        transformer_config_from_hf({"architectures": ["MistralForCausalLM"]})
