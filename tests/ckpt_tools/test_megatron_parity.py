"""Megatron-core reproduces HF logits from a torch_dist checkpoint.

The checkpoint is the converter's output (ckpt_tools.convert, plain DCP, no megatron involved
in writing), read back at TP=1 in this process and at TP=2 (EP=2 for MoE) in two spawned
processes (one GPU each where there are two, else gloo on CPU). The spawned ranks load every
selected case's checkpoint in turn (megatron's groups made again for each), once for the module:
a spawn and megatron's import are most of a load's time on CPU.
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
    GATED_DELTA_NET_ARCHITECTURES,
    MINIMAX_ARCHITECTURES,
    MOE_ARCHITECTURES,
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
from ckpt_tools.model_shape import ModelShape
from ckpt_tools.qwen3_5_config import language_model_config
from ckpt_tools.torch_dist import read_metadata
from tests.ckpt_tools.tiny_hf import make_tiny_hf
from tests.rank_devices import init_rank, rank_devices, start_ranks

ATOL = 1e-5  # float32 end to end; TP only reorders sums
# Qwen3-Next: float32 rounding of the gated delta rule (chunked triangular solves, exponentials of cumulative
# decays): transformers' own float32 logits are 3.3e-5 from its float64 ones on such a model (40 tokens; a Qwen3's,
# ~1e-6); a misplaced tensor is off by far more (test_naive_qkv_layout_is_caught)
ARCH_ATOL = {arch: 1e-4 for arch in GATED_DELTA_NET_ARCHITECTURES}
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
    # Qwen3.5: the gated delta nets' projections apart; a dense MLP, or MoE; a multimodal checkpoint (its language
    # model under model.language_model., a vision tower left aside) whose experts are fused, as released ones
    "qwen3_5": ("qwen3_5", False),
    "qwen3_5_moe": ("qwen3_5_moe", False),
    "qwen3_5_moe_vl": ("qwen3_5_moe_vl", False),
}
INPUT_IDS = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))


@dataclass
class Case:
    id: str
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


class Cases:
    """Each case's HF model, its logits and its converted checkpoint, made on first use."""

    def __init__(self, tmp_path_factory: pytest.TempPathFactory) -> None:
        self._tmp_path_factory = tmp_path_factory
        self._built: dict[str, Case] = {}

    def get(self, case_id: str) -> Case:
        if case_id not in self._built:
            self._built[case_id] = self._build(case_id)
        return self._built[case_id]

    def _build(self, case_id: str) -> Case:
        arch, tied = CASES[case_id]
        root = self._tmp_path_factory.mktemp(case_id)
        hf_dir = make_tiny_hf(arch, root / "hf", tied=tied)
        hf_config = language_model_config(json.loads((hf_dir / "config.json").read_text()))
        hf_model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
        with torch.no_grad():
            hf_logits = hf_model(INPUT_IDS).logits
        hf_state = load_file(hf_dir / "model.safetensors")
        # What is checked is the converter's own output (plain DCP, no megatron involved in writing).
        ckpt_dir = hf_to_torch_dist(hf_dir, root / "converted", make_vocab_size_divisible_by=128, progress=False)
        return Case(case_id, hf_config, hf_state, hf_logits, ckpt_dir)


@pytest.fixture(scope="module")
def cases(tmp_path_factory) -> Cases:
    return Cases(tmp_path_factory)


@pytest.fixture(scope="module", params=list(CASES))
def case(request, cases: Cases, lone_process_group) -> Case:
    return cases.get(request.param)


def test_tp1_load_matches_hf(case: Case) -> None:
    model = build_gpt_model(case.hf_config)
    load_torch_dist(model, case.ckpt_dir)
    _assert_close(megatron_logits(model, INPUT_IDS), case.hf_logits, case.hf_config)


def test_tied_untied_mismatch_is_reported(case: Case) -> None:
    """Strict both ways: output_layer.weight is either unused or missing."""
    flipped = {**case.hf_config, "tie_word_embeddings": not case.hf_config.get("tie_word_embeddings", False)}
    with pytest.raises(RuntimeError, match="output_layer.weight"):
        load_torch_dist(build_gpt_model(flipped), case.ckpt_dir)


# The two spawned ranks' runs: "parallel" loads at TP=2 (EP=2 for MoE), "tp2_sp_ep2" at TP=2 with SP and EP=2 in the
# trainer's layer spec. Each test of them names its run.
PARALLEL_TESTS = {"test_parallel_load_matches_hf": "parallel", "test_tp2_sp_ep2_matches_hf": "tp2_sp_ep2"}


def _runs_tp2_sp_ep2(hf_config: dict) -> bool:
    return hf_config["architectures"][0] in (*MINIMAX_ARCHITECTURES, *GATED_DELTA_NET_ARCHITECTURES)


def _parallel_model(hf_config: dict) -> torch.nn.Module:
    # MoE with TP > 1 needs sequence parallel, which the torch norm refuses: split experts instead.
    tp, ep = (1, 2) if hf_config["architectures"][0] in MOE_ARCHITECTURES else (2, 1)
    init_parallel(tp, ep)
    return build_gpt_model(hf_config, tp, ep)


def _tp2_sp_ep2_model(hf_config: dict) -> torch.nn.Module:
    from megatron.core.models.gpt import GPTModel

    from trainer.megatron.attention import gpt_block_spec

    moe = hf_config["architectures"][0] in MOE_ARCHITECTURES
    init_parallel(tp=2, ep=2 if moe else 1, etp=1)
    config, model_kwargs = transformer_config_from_hf(hf_config, tp=2, ep=2 if moe else 1, etp=1,
                                                      sequence_parallel=True)
    shape = ModelShape.from_hf_config(hf_config)
    spec = gpt_block_spec(config, "local", full_qk_norm=shape.full_qk_norm, split_gdn=shape.split_gdn_projections)
    model = GPTModel(config=config, transformer_layer_spec=spec, **model_kwargs)
    if torch.cuda.is_available():  # the torch norms are built on the CPU whatever the config says
        model = model.to(torch.device("cuda", torch.cuda.current_device()))
    model.hf_vocab_size = hf_config["vocab_size"]
    return model


ParallelRun = tuple[str, str, dict, Path]  # case id, run ("parallel" or "tp2_sp_ep2"), HF config, checkpoint


def _parallel_worker(rank: int, world: int, init_file: str, runs: list[ParallelRun], out_dir: Path) -> None:
    from megatron.core import parallel_state

    init_rank(rank, world, init_file)
    for case_id, run, hf_config, ckpt_dir in runs:
        try:
            model = (_parallel_model if run == "parallel" else _tp2_sp_ep2_model)(hf_config)
            load_torch_dist(model, ckpt_dir)
            torch.save(megatron_logits(model, INPUT_IDS), out_dir / f"{case_id}-{run}-{rank}.pt")
        except Exception as err:  # start_processes stops the other rank and raises this in the test process
            raise RuntimeError(f"{case_id} ({run}) failed on rank {rank}") from err
        parallel_state.destroy_model_parallel()
    destroy_parallel()


@dataclass
class ParallelLogits:
    out_dir: Path
    error: str | None  # why the spawn stopped before its last run, if it did

    def ranks(self, case_id: str, run: str) -> list[torch.Tensor]:
        paths = [self.out_dir / f"{case_id}-{run}-{rank}.pt" for rank in range(2)]
        if not all(path.exists() for path in paths):
            pytest.fail(f"{case_id} ({run}): no logits; the ranks stopped at this run or before it: {self.error}")
        return [torch.load(path) for path in paths]


@pytest.fixture(scope="module")
def parallel_logits(request, cases: Cases, tmp_path_factory) -> ParallelLogits:
    """The logits of every selected parallel test's case, by both ranks of one spawn."""
    runs: list[ParallelRun] = []
    for item in request.session.items:
        run = PARALLEL_TESTS.get(getattr(item, "originalname", ""))
        if run and getattr(item, "module", None) is request.module:
            case_id = item.callspec.params["case"]
            case = cases.get(case_id)
            if run == "parallel" or _runs_tp2_sp_ep2(case.hf_config):
                runs.append((case_id, run, case.hf_config, case.ckpt_dir))
    out_dir = tmp_path_factory.mktemp("parallel_logits")
    error = None
    # start_ranks stops the other rank if one fails.
    with rank_devices(2):
        try:
            start_ranks(_parallel_worker, (2, str(out_dir / "rendezvous"), runs, out_dir), 2)
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as err:  # the runs left undone fail with it
            error = str(err)
    return ParallelLogits(out_dir, error)


def test_parallel_load_matches_hf(case: Case, parallel_logits: ParallelLogits) -> None:
    for logits in parallel_logits.ranks(case.id, "parallel"):
        _assert_close(logits, case.hf_logits, case.hf_config)


def test_tp2_sp_ep2_matches_hf(request, case: Case) -> None:
    """With SP (which MoE under TP needs) and EP=2, in the trainer's layer spec (whose norms take SP): MiniMax-M2's
    q/k norms span the heads of both TP ranks; Qwen3-Next's gated delta nets run whole on each rank over the
    gathered sequence, its gated attention's query and gate split by head."""
    if not _runs_tp2_sp_ep2(case.hf_config):
        pytest.skip("MiniMax-M2, Qwen3-Next and Qwen3.5 only")
    parallel_logits: ParallelLogits = request.getfixturevalue("parallel_logits")  # after the skip: spawns none for it
    for logits in parallel_logits.ranks(case.id, "tp2_sp_ep2"):
        _assert_close(logits, case.hf_logits, case.hf_config)


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
    prefix = ModelShape.from_hf_config(case.hf_config).hf_prefix
    with torch.no_grad():
        for i, layer in enumerate(model.decoder.layers):
            if hasattr(layer.self_attention, "linear_qkv"):  # not a gated delta net (Qwen3-Next)
                naive = torch.cat([case.hf_state[f"{prefix}layers.{i}.self_attn.{p}_proj.weight"] for p in "qkv"])
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
