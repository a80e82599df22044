"""Qwen3-Next (transformers' Qwen3NextForCausalLM) in the trainer, from slime's scripts/models/qwen3-next-80B-A3B.sh
model flags at a tiny model's sizes (its --spec slime_plugins.models.qwen3_next get_qwen3_next_spec: three gated
delta net layers then one of gated full attention, zero-centred norms, every layer MoE with a gated shared expert;
each flag checked against config.json), with the torch gated-delta-rule kernel: one RL step gives HF's log-probs
and the same loss, grad norm and new weights at TP=1 (unfused and fused attention), at TP=2 + SP with the experts
over the two ranks (EP=2), at DP=2 and at CP=2 (every CP rank runs the gated delta nets over whole samples);
PP=2 of a MoE needs the alltoall dispatcher (CUDA only): with a GPU per rank, TP=1 and PP=2 both under alltoall
give the same step. Flags that do not fit the checkpoint are named. End to
end (`python -m trainer`, a stand-in engine serving transformers' Qwen3Next behind the real router): every
published version reaches the engine intact (on policy), over a weight-update group.

Qwen3.5-MoE likewise (slime's scripts/models/qwen3.5-35B-A3B.sh flags, its --spec slime_plugins.models.qwen3_5
get_qwen3_5_spec), from a released checkpoint's layout (multimodal, experts fused): one RL step at TP=1 and at
TP=2 + SP + EP=2, in the same spawns as Qwen3-Next's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from ckpt_tools.mapping import ModelShape
from tests.ckpt_tools.tiny_hf import make_tiny_hf
from tests.rank_devices import hidden_gpus, rank_devices
from tests.trainer.same_step import (
    assert_every_name_published,
    assert_log_probs_equal_hf,
    assert_same_step,
    tiny_with_torch_dist,
)
from tests.trainer.test_megatron_backend import run_all_models
from tests.trainer.test_megatron_glm4 import _check, assert_rl_loop_on_policy
from trainer.args import ArgsError, read_hf_config

# scripts/models/qwen3-next-80B-A3B.sh at the tiny model's sizes, but for --moe-token-dispatcher-type alltoall (CUDA
# only) and the gated delta rule's kernel (fla's is CUDA only)
QWEN3_NEXT_FLAGS = [
    "--spec", "slime_plugins.models.qwen3_next", "get_qwen3_next_spec", "--disable-bias-linear", "--qk-layernorm",
    "--group-query-attention", "--num-attention-heads", "4", "--num-query-groups", "2", "--kv-channels", "16",
    "--num-layers", "4", "--hidden-size", "64", "--ffn-hidden-size", "128", "--use-gated-attention",
    "--normalization", "RMSNorm", "--apply-layernorm-1p", "--position-embedding-type", "rope", "--norm-epsilon", "1e-6",
    "--rotary-percent", "0.25", "--swiglu", "--untie-embeddings-and-output-weights", "--vocab-size", "128",
    "--rotary-base", "10000000", "--moe-ffn-hidden-size", "32", "--moe-shared-expert-intermediate-size", "32",
    "--moe-router-score-function", "softmax", "--moe-router-topk", "2", "--moe-layer-freq", "[1,1,1,1]",
    "--num-experts", "4", "--moe-grouped-gemm", "--moe-token-drop-policy", "probs", "--moe-router-dtype", "fp32",
    "--moe-permute-fusion", "--moe-aux-loss-coeff", "0", "--attention-output-gate", "--moe-shared-expert-gate",
    "--qwen-gdn-backend", "torch",
]
# float32 rounding of the gated delta rule (chunked triangular solves, exponentials of cumulative decays): on this
# model transformers' own float32 logits are 3.3e-5 from its float64 ones (the trainer's, 3.2e-5), against ~1e-6
# for a Qwen3; a misplaced or untrained tensor is off by far more (tests.ckpt_tools.test_megatron_parity)
ATOL = 1e-4
EP2 = ["--sequence-parallel", "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1"]
LAYOUTS = {"tp1": (1, 1, "local", []), "tp1_sdpa": (1, 1, "sdpa", []), "tp2_sp_ep2": (2, 2, "local", EP2),
           "tp2_sp_ep2_sdpa": (2, 2, "sdpa", EP2),
           # the dense and expert gradients summed in small buckets during the backward (trainer.grad_buckets)
           "dp2": (1, 2, "sdpa", ["--overlap-grad-reduce", "--ddp-bucket-size", "2000"]),
           "cp2": (1, 2, "sdpa", ["--context-parallel-size", "2"])}
ALLTOALL = ["--moe-token-dispatcher-type", "alltoall"]
# megatron's allgather dispatcher under PP=2 is refused (trainer.args), its alltoall runs on CUDA only: these two run
# where each rank has a GPU of its own (the GPU machine; tests.rank_devices), against each other
ALLTOALL_LAYOUTS = {"tp1_alltoall": (1, 1, "sdpa", ALLTOALL),
                    "pp2_alltoall": (1, 2, "sdpa", [*ALLTOALL, "--pipeline-model-parallel-size", "2"])}
# scripts/models/qwen3.5-35B-A3B.sh at the tiny model's sizes, as QWEN3_NEXT_FLAGS; --ffn-hidden-size is an expert's
# width there (the config has no dense one)
QWEN3_5_FLAGS = [
    "--spec", "slime_plugins.models.qwen3_5", "get_qwen3_5_spec",
    *QWEN3_NEXT_FLAGS[QWEN3_NEXT_FLAGS.index("get_qwen3_next_spec") + 1:]]
QWEN3_5_FLAGS[QWEN3_5_FLAGS.index("--ffn-hidden-size") + 1] = "32"
QWEN3_5_LAYOUTS = {"tp1": (1, 1, "local", []), "tp2_sp_ep2": (2, 2, "local", EP2)}
# scripts/models/qwen3.5-9B.sh (dense) at the tiny model's sizes; its 27B sibling's recipe splits the layers over
# two pipeline stages
QWEN3_5_DENSE_FLAGS = [*QWEN3_5_FLAGS[:QWEN3_5_FLAGS.index("--moe-ffn-hidden-size")], "--attention-output-gate",
                       "--qwen-gdn-backend", "torch"]
QWEN3_5_DENSE_FLAGS[QWEN3_5_DENSE_FLAGS.index("--ffn-hidden-size") + 1] = "128"
QWEN3_5_DENSE_LAYOUTS = {"tp1": (1, 1, "sdpa", []), "tp2_sp": (2, 2, "local", ["--sequence-parallel"]),
                         "pp2": (1, 2, "sdpa", ["--pipeline-model-parallel-size", "2"])}
Runs = tuple[Path, dict[str, dict]]  # the tiny model, each layout's RL step


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Runs]:
    """The tiny models (Qwen3.5-MoE's a multimodal checkpoint with fused experts), and each layout's RL step from
    its torch_dist conversion: the layouts of one world size in one spawn."""
    on_gpus = torch.cuda.is_available() and not hidden_gpus(2)
    tables = {"qwen3_next": (QWEN3_NEXT_FLAGS, {**LAYOUTS, **(ALLTOALL_LAYOUTS if on_gpus else {})}),
              "qwen3_5_moe_vl": (QWEN3_5_FLAGS, QWEN3_5_LAYOUTS),
              "qwen3_5": (QWEN3_5_DENSE_FLAGS, QWEN3_5_DENSE_LAYOUTS)}
    models = {arch: tiny_with_torch_dist(arch, tmp_path_factory.mktemp(arch)) for arch in tables}
    layouts = {f"{arch}-{name}": (models[arch], tp, world, attention, [*flags, *extra])
               for arch, (flags, table) in tables.items() for name, (tp, world, attention, extra) in table.items()}
    with rank_devices(2):
        results = run_all_models(tmp_path_factory.mktemp("runs"), layouts)
    return {arch: (model, {name.split("-", 1)[1]: r for name, r in results.items() if name.startswith(f"{arch}-")})
            for arch, (model, _) in models.items()}


@pytest.fixture(scope="module")
def tiny(runs: dict[str, Runs]) -> Runs:
    return runs["qwen3_next"]


@pytest.fixture(scope="module")
def qwen3_5(runs: dict[str, Runs]) -> Runs:
    return runs["qwen3_5_moe_vl"]


@pytest.fixture(scope="module")
def qwen3_5_dense(runs: dict[str, Runs]) -> Runs:
    return runs["qwen3_5"]


def test_log_probs_equal_hf(tiny) -> None:
    assert_log_probs_equal_hf(*tiny, atol=ATOL)


def test_one_step_is_the_same_at_every_layout(tiny) -> None:
    """Every weight moves (the gated delta nets', the zero-centred norms', the gated shared expert's)."""
    _, results = tiny
    for name in LAYOUTS:
        assert_same_step(results["tp1"], results[name], name, ATOL)


def test_pp2_with_the_alltoall_dispatcher_is_the_same_step(tiny) -> None:
    _, results = tiny
    if "pp2_alltoall" not in results:
        pytest.skip("PP=2 of a MoE needs the alltoall dispatcher, CUDA only: needs 2 CUDA GPUs, a GPU per rank")
    assert_same_step(results["tp1_alltoall"], results["pp2_alltoall"], "pp2_alltoall", ATOL)


def test_every_checkpoint_name_is_published(tiny) -> None:
    """The publish path sends exactly the checkpoint's names (the gated delta nets' and the gated shared expert's)."""
    names = assert_every_name_published(*tiny)
    assert {"model.layers.2.linear_attn.in_proj_qkvz.weight", "model.layers.1.mlp.shared_expert_gate.weight"} <= names


def test_flags_that_do_not_fit_the_checkpoint_are_named(tiny, tmp_path: Path) -> None:
    model, _ = tiny
    _check(model, QWEN3_NEXT_FLAGS)  # slime's pass
    wrong = {"--rotary-percent": "0.5", "--moe-shared-expert-intermediate-size": "64", "--kv-channels": "32"}
    with pytest.raises(ArgsError) as err:
        _check(model, [*QWEN3_NEXT_FLAGS, *(token for item in wrong.items() for token in item)])
    assert {line.split(" disagrees with")[0] for line in err.value.problems} == {
        f"{flag} {value}" for flag, value in wrong.items()}
    qwen3_moe = make_tiny_hf("qwen3_moe", tmp_path / "qwen3_moe", tied=False)
    with pytest.raises(ArgsError) as err:
        _check(qwen3_moe, ["--apply-layernorm-1p", "--attention-output-gate", "--moe-shared-expert-gate"])
    assert {line.split(" disagrees with")[0] for line in err.value.problems} == {
        "--apply-layernorm-1p True", "--attention-output-gate True", "--moe-shared-expert-gate True"}


@pytest.mark.parametrize(("field", "value", "message"), [
    ("decoder_sparse_step", 2, "decoder_sparse_step"), ("shared_expert_intermediate_size", 0, "gated shared expert"),
    ("layer_types", ["linear_attention", "sliding_attention", "linear_attention", "full_attention"], "layer_types")])
def test_a_config_slurmrl_would_compute_otherwise_is_named(tiny, field: str, value: object, message: str) -> None:
    model, _ = tiny
    config = {**json.loads((model / "config.json").read_text()), field: value}
    with pytest.raises(ValueError, match=f"^config.json: .*{message}"):
        ModelShape.from_hf_config(config)


def test_qwen3_5_one_step_equals_hf_and_is_the_same_at_tp2_sp_ep2(qwen3_5: Runs) -> None:
    """Every weight moves (the split gated delta net projections' among them) the same way at both layouts."""
    assert_log_probs_equal_hf(*qwen3_5, atol=ATOL)
    assert_same_step(qwen3_5[1]["tp1"], qwen3_5[1]["tp2_sp_ep2"], "tp2_sp_ep2", ATOL)


def test_qwen3_5_dense_one_step_is_the_same_at_tp2_sp_and_pp2(qwen3_5_dense: Runs) -> None:
    """Qwen3.5's dense MLP beside the gated delta nets; over two pipeline stages (two of them on each)."""
    assert_log_probs_equal_hf(*qwen3_5_dense, atol=ATOL)
    for name in ("tp2_sp", "pp2"):
        assert_same_step(qwen3_5_dense[1]["tp1"], qwen3_5_dense[1][name], name, ATOL)
    assert_every_name_published(*qwen3_5_dense)


def test_qwen3_5_publishes_its_language_models_names(qwen3_5: Runs) -> None:
    """The multimodal checkpoint's language-model names (model.language_model.), each expert's projections apart
    (as slime sends SGLang), the vision tower not (it is not trained)."""
    model, results = qwen3_5
    with safe_open(str(model / "model.safetensors"), framework="pt") as f:
        names = {name for name in f.keys() if not name.startswith("model.visual.")}
    fused = {name for name in names if name.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    apart = {f"{name.rsplit('.', 1)[0]}.{e}.{proj}.weight" for name in fused for e in range(4)
             for proj in (("gate_proj", "up_proj") if name.endswith("gate_up_proj") else ("down_proj",))}
    assert "model.language_model.layers.0.linear_attn.in_proj_qkv.weight" in names and len(fused) == 8
    for name, result in results.items():
        assert set(result["weights"]) == (names - fused) | apart, name


def test_qwen3_5_flags_are_checked_against_text_config(qwen3_5: Runs) -> None:
    """slime's flags pass against the multimodal config.json's text_config; one that disagrees is named."""
    model, _ = qwen3_5
    config = read_hf_config(str(model))
    _check(model, QWEN3_5_FLAGS, config)
    with pytest.raises(ArgsError) as err:
        _check(model, [*QWEN3_5_FLAGS, "--num-experts", "8"], config)
    assert [line.split(" disagrees with")[0] for line in err.value.problems] == ["--num-experts 8"]


@pytest.mark.parametrize(("arch", "flags"), [("qwen3_next", QWEN3_NEXT_FLAGS), ("qwen3_5_moe_vl", QWEN3_5_FLAGS)])
def test_every_version_reaches_the_engine_in_the_rl_loop(tmp_path: Path, arch: str, flags: list[str]) -> None:
    """Published over a weight-update group (gloo on the CPU) under the checkpoint's names, each version serves
    (Qwen3.5's multimodal checkpoint: the engine serves its language model, as transformers loads it)."""
    assert_rl_loop_on_policy(arch, flags, tmp_path, "nccl")
