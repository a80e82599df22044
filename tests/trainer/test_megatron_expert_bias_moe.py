"""DeepSeek-V3's MoE (a shared expert, sigmoid expert-bias grouped routing, dense first layers) in the
trainer, under its multi-latent attention with YaRN, under GLM-4.5's standard attention (q/k/v bias,
q/k norms, RoPE over half of each head) and under GLM-4.7-Flash's MLA, from slime's model flags (each
checked against config.json): on a tiny model of each, one RL step gives HF's log-probs and the same
loss, grad norm, new weights and new routing biases at TP=1, at TP=1 with the fused attention path
(packed rows), and at TP=2 + SP with the experts spread over the two ranks (EP=2); the bias moves as
megatron moves it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from ckpt_tools.convert import hf_to_torch_dist
from tests.ckpt_tools.tiny_hf import make_tiny_hf, tiny_config
from tests.rank_devices import rank_devices
from tests.trainer.same_step import assert_log_probs_equal_hf
from tests.trainer.test_megatron_backend import ATOL, run_all_models

BIAS_RATE = 1e-3
# the MoE flags of slime's DeepSeek-V3 and GLM-4.5 model scripts, at the tiny models' sizes
MOE_FLAGS = [
    "--num-experts", "8", "--moe-router-topk", "4", "--moe-ffn-hidden-size", "32",
    "--moe-shared-expert-intermediate-size", "32", "--moe-router-pre-softmax",
    "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
    "--moe-router-bias-update-rate", str(BIAS_RATE), "--moe-router-topk-scaling-factor", "2.5",
    "--moe-router-num-groups", "4", "--moe-router-group-topk", "2",
    "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-aux-loss-coeff", "0",
    # The tiny models' first layer is dense (first_k_dense_replace 1), as real DeepSeek-V3, Kimi-K2 and
    # GLM-4.5 checkpoints; layers 1 and 2 are MoE. (An all-MoE model is the same code but for the stacked
    # checkpoint keys, which Qwen3-MoE's trainer tests and ckpt_tools' DeepSeek tests cover.)
    "--moe-layer-freq", "[0]*1+[1]*2",
]
FAMILIES = {  # tiny_hf arch: its attention's flags (scripts/models/deepseek-v3.sh, glm4.5-355B-A32B.sh)
    "deepseek_v3_dense_first": [
        "--multi-latent-attention", "--q-lora-rank", "48", "--kv-lora-rank", "32", "--qk-head-dim", "16",
        "--qk-pos-emb-head-dim", "8", "--v-head-dim", "16", "--kv-channels", "16", "--qk-layernorm",
        "--rotary-scaling-factor", "4", "--mscale", "1.0", "--mscale-all-dim", "0.8",  # the tiny model's YaRN
    ],
    # glm4.7-30B-A3B.sh (GLM-4.7-Flash): DeepSeek's attention; its --add-qkv-bias and --no-position-embedding
    # change nothing there, as in megatron
    "glm4_moe_lite": [
        "--multi-latent-attention", "--q-lora-rank", "48", "--kv-lora-rank", "32", "--qk-head-dim", "16",
        "--qk-pos-emb-head-dim", "8", "--v-head-dim", "16", "--kv-channels", "16", "--qk-layernorm",
        "--add-qkv-bias", "--disable-bias-linear", "--no-position-embedding", "--rotary-base", "1000000",
    ],
    "glm4_moe": ["--qk-layernorm", "--group-query-attention", "--num-attention-heads", "4", "--num-query-groups", "2",
                 "--kv-channels", "16", "--add-qkv-bias", "--disable-bias-linear", "--rotary-percent", "0.5",
                 "--rotary-base", "1000000", "--moe-router-dtype", "fp32"],
}
# As Qwen3-MoE's (test_megatron_moe_parallel): EP over the TP ranks with sequence parallelism. EP
# over data-parallel ranks with the allgather dispatcher needs equal token counts on every rank (gloo).
LAYOUTS = {"tp2_sp_ep2": (2, 2, "local", ["--sequence-parallel", "--expert-model-parallel-size", "2",
                                          "--expert-tensor-parallel-size", "1"])}
BIAS = "model.layers.{}.mlp.gate.e_score_correction_bias"
MOE_LAYERS = (1, 2)


@pytest.fixture(scope="module", params=list(FAMILIES))
def arch(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """Each family's tiny HF model and its torch_dist checkpoint, by _tiny_model on first use."""
    return {}


def _tiny_model(arch: str, tiny_models: dict[str, tuple[Path, Path]], tmp_path_factory) -> tuple[Path, Path]:
    if arch not in tiny_models:
        root = tmp_path_factory.mktemp(arch)
        model = make_tiny_hf(arch, root / "model", tied=False)
        tiny_models[arch] = model, hf_to_torch_dist(model, root / "torch_dist", iteration=None, progress=False)
    return tiny_models[arch]


@pytest.fixture(scope="module")
def tiny(arch: str, tiny_models, tmp_path_factory) -> tuple[Path, Path]:
    return _tiny_model(arch, tiny_models, tmp_path_factory)


@pytest.fixture(scope="module")
def every_family_results(request: pytest.FixtureRequest, tiny_models, tmp_path_factory) -> dict[str, dict[str, dict]]:
    """The runs of every family a selected test needs, all in one spawn per world size (a spawn and
    megatron's import are most of a run's time on CPU): by family, then by layout."""
    archs = sorted({item.callspec.params["arch"] for item in request.session.items
                    if getattr(item, "module", None) is request.module and "results" in item.fixturenames})
    # tp1_sdpa: the fused attention path a GPU takes by default (--attention-backend auto), packed rows
    runs = {"tp1": (1, 1, "local", []), "tp1_sdpa": (1, 1, "sdpa", [])} | LAYOUTS
    with rank_devices(2):
        done = run_all_models(tmp_path_factory.mktemp("runs"), {
            f"{arch}-{name}": (_tiny_model(arch, tiny_models, tmp_path_factory), tp, world, attention,
                               [*FAMILIES[arch], *MOE_FLAGS, *extra])
            for arch in archs for name, (tp, world, attention, extra) in runs.items()})
    return {arch: {name: done[f"{arch}-{name}"] for name in runs} for arch in archs}


@pytest.fixture(scope="module")
def results(arch: str, every_family_results) -> dict[str, dict]:
    return every_family_results[arch]


def test_log_probs_equal_hf(tiny, results) -> None:
    assert_log_probs_equal_hf(tiny[0], results)


def test_one_step_is_the_same_at_tp2_ep2_and_with_fused_attention(arch: str, results) -> None:
    base = results["tp1"]
    assert base["metrics"]["grad_norm"] > 0.5, "the step must clip to be a test"
    for name in [*LAYOUTS, "tp1_sdpa"]:
        other = results[name]
        for key in ("loss", "pg_loss", "clipfrac", "grad_norm"):
            assert other["metrics"][key] == pytest.approx(base["metrics"][key], abs=ATOL), f"{name}: {key}"
        assert other["weights"].keys() == base["weights"].keys()
        for hf_name, tensor in base["weights"].items():
            assert (other["weights"][hf_name] - tensor).abs().max() < ATOL, f"{name}: {hf_name} after the step"
    attention = "kv_b_proj.weight" if "--multi-latent-attention" in FAMILIES[arch] else "q_proj.bias"
    for hf_name in (f"model.layers.0.self_attn.{attention}", "model.layers.1.mlp.shared_experts.up_proj.weight",
                    "model.layers.1.mlp.gate.weight", "model.layers.0.mlp.gate_proj.weight",  # the dense layer's MLP
                    "model.layers.0.mlp.down_proj.weight"):
        assert not torch.equal(base["weights"][hf_name], base["before"][hf_name]), f"{hf_name} must train"


def test_every_hf_weight_is_published(tiny, results) -> None:
    """The publish path sends exactly the checkpoint's HF names (dense layers' MLP included), at every layout."""
    model, _ = tiny
    with safe_open(str(model / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    for name, result in results.items():
        assert set(result["weights"]) == names, f"{name}: {set(result['weights']) ^ names}"


def test_routing_bias_moves_by_the_rate_towards_balance(results) -> None:
    """Each expert's bias moves by +-rate (or stays, at exactly average load), and the step is
    published with it (the engines route with it)."""
    for layer in MOE_LAYERS:
        before, after = results["tp1"]["before"][BIAS.format(layer)], results["tp1"]["weights"][BIAS.format(layer)]
        steps = ((after - before) / BIAS_RATE).round()
        assert torch.allclose(after - before, steps * BIAS_RATE, atol=1e-7)
        assert set(steps.tolist()) <= {-1.0, 0.0, 1.0} and steps.abs().sum() >= 2, f"layer {layer}: {steps}"


WRONG = {  # flags that disagree with the tiny model's config.json, each named in the error
    "deepseek_v3_dense_first": {"--q-lora-rank": "64", "--moe-router-num-groups": "8", "--mscale-all-dim": "1.0",
                                "--rotary-scaling-factor": "40.0"},
    "glm4_moe": {"--rotary-percent": "1.0", "--moe-router-num-groups": "8", "--kv-channels": "32"},
    "glm4_moe_lite": {"--v-head-dim": "32", "--moe-ffn-hidden-size": "64"},
}


def test_a_flag_that_disagrees_with_config_json_is_named(arch: str, tiny) -> None:
    from trainer.args import ArgsError, build_config, build_parser
    from trainer.config.model_checks import check_model_flags

    model, _ = tiny
    config = json.loads((model / "config.json").read_text())
    common = ["--hf-checkpoint", str(model), "--num-rollout", "1", "--debug-train-only", "--n-samples-per-prompt", "2",
              "--load-debug-rollout-data", "x", *FAMILIES[arch], *MOE_FLAGS]
    check_model_flags(build_config(build_parser().parse_args(common)).shape, str(model), config)  # slime's pass
    wrong = [token for flag, value in WRONG[arch].items() for token in (flag, value)]
    with pytest.raises(ArgsError) as err:
        check_model_flags(build_config(build_parser().parse_args([*common, *wrong])).shape, str(model), config)
    assert {line.split(" disagrees with")[0] for line in err.value.problems} == {
        f"{flag} {value}" for flag, value in WRONG[arch].items()}
    if arch.startswith("deepseek"):  # Moonlight's scripts: no RoPE scaling, factor 1, mscales that change nothing
        plain = {**config, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
        check_model_flags(build_config(build_parser().parse_args([*common, "--rotary-scaling-factor", "1"])).shape,
                          str(model), plain)
        # a YaRN megatron-core cannot build: named, in one line, not a traceback
        odd = {**config, "rope_parameters": {**config["rope_parameters"], "attention_factor": 1.5}}
        with pytest.raises(ArgsError) as err:
            check_model_flags(build_config(build_parser().parse_args(common)).shape, str(model), odd)
        [line] = [line for line in err.value.problems if "YaRN attention_factor is not supported" in line]
        assert line.startswith("--rotary-scaling-factor 4.0: ") and f"{model}/config.json: YaRN" in line, line


@pytest.mark.parametrize(("arch_name", "freq", "expected"), [
    ("deepseek_v3_dense_first", "1", "([0]*1+[1]*2, first_k_dense_replace 1, num_hidden_layers 3)"),
    ("deepseek_v3_dense_first", "[0, 0, 1]", "([0]*1+[1]*2, first_k_dense_replace 1, num_hidden_layers 3)"),
    ("deepseek_v3", "[0]*1+[1]*1", "(1, first_k_dense_replace 0, num_hidden_layers 2)"),
])
def test_moe_layer_freq_must_match_first_k_dense_replace(tmp_path: Path, arch_name: str, freq: str,
                                                         expected: str) -> None:
    """slime's --moe-layer-freq against config.json's first_k_dense_replace: one line naming both."""
    from trainer.args import ArgsError, build_config, build_parser
    from trainer.config.model_checks import check_model_flags

    model = tmp_path / "model"
    model.mkdir()
    config = json.loads(tiny_config(arch_name).to_json_string())
    (model / "config.json").write_text(json.dumps(config))
    argv = ["--hf-checkpoint", str(model), "--num-rollout", "1", "--debug-train-only", "--n-samples-per-prompt", "2",
            "--load-debug-rollout-data", "x", *FAMILIES["deepseek_v3_dense_first"], *MOE_FLAGS[:-2],
            "--moe-layer-freq", freq]
    with pytest.raises(ArgsError) as err:
        check_model_flags(build_config(build_parser().parse_args(argv)).shape, str(model), config)
    (line,) = err.value.problems
    assert line.startswith("--moe-layer-freq ") and f"disagrees with {model}/config.json {expected}" in line
