"""MiniMax-M2 (transformers' MiniMaxM2ForCausalLM) in the trainer, from slime's scripts/models/minimax-m2.sh model
flags at a tiny model's sizes (its --spec slime_plugins.models.minimax_m2 get_minimax_m2_layer_spec, q/k norms over
all heads, RoPE over half of each head, sigmoid expert-bias MoE in every layer; each flag checked against
config.json): one RL step gives HF's log-probs and the same loss, grad norm and new weights at TP=1 and at TP=2 + SP
with the experts over the two ranks (EP=2), with unfused and fused attention. The q/k norms' sum of squares spans
both TP ranks, and their gradient (slime's q_norm and k_norm) is summed once. Flags and --spec that do not fit the
checkpoint are named. End to end (`python -m trainer`, a stand-in engine serving transformers' MiniMaxM2 behind the
real router): every published version reaches the engine intact (on policy), over a weight-update group."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import transformers

from ckpt_tools import rope
from ckpt_tools.mapping import ModelShape
from tests.ckpt_tools.tiny_hf import make_tiny_hf
from tests.trainer.same_step import (
    assert_every_name_published,
    assert_log_probs_equal_hf,
    run_layouts,
    tiny_with_torch_dist,
)
from tests.trainer.test_megatron_backend import ATOL
from tests.trainer.test_megatron_glm4 import _check, assert_rl_loop_on_policy
from trainer.args import ArgsError

# scripts/models/minimax-m2.sh at the tiny model's sizes, but for --moe-token-dispatcher-type alltoall (CUDA only)
MINIMAX_FLAGS = [
    "--spec", "slime_plugins.models.minimax_m2", "get_minimax_m2_layer_spec", "--disable-bias-linear",
    "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "32", "--num-attention-heads", "4",
    "--kv-channels", "16", "--num-query-groups", "2", "--normalization", "RMSNorm",
    "--position-embedding-type", "rope", "--norm-epsilon", "1e-6", "--swiglu", "--untie-embeddings-and-output-weights",
    "--vocab-size", "128", "--group-query-attention", "--rotary-percent", "0.5", "--rotary-base", "5000000",
    "--qk-layernorm", "--no-rope-fusion", "--attention-softmax-in-fp32",
    "--num-experts", "8", "--moe-ffn-hidden-size", "32", "--moe-router-topk", "2", "--moe-layer-freq", "[1]*2",
    "--moe-router-pre-softmax", "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
    "--moe-router-load-balancing-type", "none", "--moe-router-dtype", "fp32", "--moe-aux-loss-coeff", "0",
    "--moe-grouped-gemm", "--moe-permute-fusion", "--model-name", "minimax_m2",
]
EP2 = ["--sequence-parallel", "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1"]
LAYOUTS = {"tp1": (1, 1, "local", []), "tp1_sdpa": (1, 1, "sdpa", []), "tp2_sp_ep2": (2, 2, "local", EP2),
           "tp2_sp_ep2_sdpa": (2, 2, "sdpa", EP2)}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, dict[str, dict]]:
    """The tiny model, and each layout's RL step from its torch_dist conversion."""
    model_and_ckpt = tiny_with_torch_dist("minimax_m2", tmp_path_factory.mktemp("minimax_m2"))
    return model_and_ckpt[0], run_layouts(model_and_ckpt, tmp_path_factory.mktemp("runs"), LAYOUTS, MINIMAX_FLAGS)


def test_log_probs_equal_hf(tiny) -> None:
    assert_log_probs_equal_hf(*tiny)


def test_one_step_is_the_same_at_tp2_sp_ep2(tiny) -> None:
    _, results = tiny
    base = results["tp1"]
    assert base["metrics"]["clipfrac"] > 0 and base["metrics"]["grad_norm"] > 0.5, "the step must clip to be a test"
    for name in LAYOUTS:
        other = results[name]
        for key in ("loss", "pg_loss", "clipfrac", "grad_norm"):
            assert other["metrics"][key] == pytest.approx(base["metrics"][key], abs=ATOL), f"{name}: {key}"
        for hf_name, tensor in base["weights"].items():
            assert (other["weights"][hf_name] - tensor).abs().max() < ATOL, f"{name}: {hf_name} after the step"
    moe = "model.layers.1.block_sparse_moe."
    for hf_name in ("model.layers.0.self_attn.q_norm.weight", "model.layers.1.self_attn.k_norm.weight",
                    moe + "gate.weight", moe + "experts.0.w3.weight", moe + "e_score_correction_bias"):
        assert not torch.equal(base["weights"][hf_name], base["before"][hf_name]), f"{hf_name} must train"


def test_every_checkpoint_name_is_published(tiny) -> None:
    """The publish path sends exactly the checkpoint's names (Mixtral's block_sparse_moe, w1/w2/w3)."""
    assert "model.layers.1.block_sparse_moe.experts.7.w2.weight" in assert_every_name_published(*tiny)


def test_flags_that_do_not_fit_the_checkpoint_are_named(tiny, tmp_path: Path) -> None:
    model, _ = tiny
    _check(model, MINIMAX_FLAGS)  # slime's pass
    _check(model, [*MINIMAX_FLAGS, "--model-name", "MiniMaxM2Config"])  # slime's default name for it
    wrong = {"--rotary-percent": "1.0", "--moe-ffn-hidden-size": "64", "--num-experts": "16"}
    with pytest.raises(ArgsError) as err:
        _check(model, [*MINIMAX_FLAGS, *(token for item in wrong.items() for token in item)])
    assert {line.split(" disagrees with")[0] for line in err.value.problems} == {
        f"{flag} {value}" for flag, value in wrong.items()}
    glm = make_tiny_hf("glm4_moe", tmp_path / "glm4_moe", tied=False)
    with pytest.raises(ArgsError) as err:
        _check(glm, ["--spec", "slime_plugins.models.minimax_m2", "get_minimax_m2_layer_spec", "--model-name",
                     "minimax_m2"])
    assert [line.split(":")[0] for line in err.value.problems] == [
        "--model-name minimax_m2", "--spec slime_plugins.models.minimax_m2 get_minimax_m2_layer_spec builds "
        "MiniMaxM2ForCausalLM layers, but " + str(glm) + " is a Glm4MoeForCausalLM"]


@pytest.mark.parametrize(("field", "value"), [("qk_norm_type", "per_head"), ("shared_intermediate_size", 32),
                                              ("scoring_func", "softmax"), ("attn_type_list", [0, 1])])
def test_a_config_megatron_would_compute_otherwise_is_named(tiny, field: str, value: object) -> None:
    """MiniMax-M2's own config.json fields that transformers' model or megatron-core would not compute as meant."""
    model, _ = tiny
    config = {**json.loads((model / "config.json").read_text()), field: value}
    with pytest.raises(ValueError, match="^" + re.escape(f"config.json: {field} {value!r} is not supported")):
        ModelShape.from_hf_config(config)


def test_every_version_reaches_the_engine_in_the_rl_loop(tmp_path: Path) -> None:
    """Published over a weight-update group (gloo on the CPU) under the checkpoint's names, each version serves."""
    assert_rl_loop_on_policy("minimax_m2", MINIMAX_FLAGS, tmp_path, "nccl")


def test_minimax_m2s_own_config_json_reads_as_transformers_reads_it(tiny) -> None:
    """MiniMax-M2's released config.json gives rotary_dim and rope_theta (no rope_parameters), and its remote code's
    fields at the values transformers' model computes: slime's flags pass against it."""
    model, _ = tiny
    config = {k: v for k, v in json.loads((model / "config.json").read_text()).items() if k != "rope_parameters"}
    config |= {"rotary_dim": 8, "rope_theta": 5000000.0, "scoring_func": "sigmoid", "use_routing_bias": True,
               "use_qk_norm": True, "qk_norm_type": "per_layer", "shared_intermediate_size": 0,
               "attn_type_list": [1, 1]}
    read = transformers.MiniMaxM2Config(**config)
    # transformers >= 5.2x reads rotary_dim as rope_parameters' share; 5.17 (the GPU machine's) keeps rotary_dim
    share = read.rope_parameters.get("partial_rotary_factor") or read.rotary_dim / read.head_dim
    assert rope.rotary_percent(config) == share == 0.5
    read = read.rope_parameters
    assert rope.rope_theta(config) == read["rope_theta"]
    _check(model, MINIMAX_FLAGS, config)
    ModelShape.from_hf_config(config)
