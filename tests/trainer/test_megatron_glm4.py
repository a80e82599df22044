"""GLM-4-0414 (transformers' Glm4ForCausalLM) in the trainer, from slime's run-glm4-9B.sh model flags at a tiny
model's sizes (its --spec slime_plugins.models.glm4 get_glm_spec, post norms, interleaved RoPE over half of each
head, q/k/v bias; each checked against config.json): one RL step gives HF's log-probs and the same loss, grad
norm and new weights at TP=1 (unfused and fused attention), at TP=2 + SP (both), at DP=2 and at PP=2; the post
norms train and are published under HF's names; flags and --spec that do not fit the checkpoint are named.
End to end (`python -m trainer`, a stand-in engine serving transformers' Glm4 behind the real router): every
published version reaches the engine intact (on policy), over a weight-update group."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors import safe_open

from rollout.toy_task import write_toy_data
from tests.ckpt_tools.tiny_hf import make_tiny_hf, tiny_hf_with_tokenizer
from tests.rollout.servers import engines_behind_router
from tests.trainer.same_step import assert_log_probs_equal_hf, assert_same_step, run_layouts, tiny_with_torch_dist
from tests.trainer.test_megatron_mtp import SAME_CPU
from tests.trainer.test_rl_loop import metrics, trainer
from trainer.args import ArgsError, build_config, build_parser
from trainer.config.model_checks import check_model_flags

# scripts/models/glm4-9B.sh, at the tiny model's sizes
GLM4_FLAGS = [
    "--spec", "slime_plugins.models.glm4", "get_glm_spec", "--swiglu", "--num-layers", "2", "--hidden-size", "64",
    "--ffn-hidden-size", "128", "--num-attention-heads", "4", "--group-query-attention", "--num-query-groups", "2",
    "--kv-channels", "16", "--use-rotary-position-embeddings", "--disable-bias-linear", "--add-qkv-bias",
    "--normalization", "RMSNorm", "--norm-epsilon", "1e-6", "--rotary-base", "10000", "--vocab-size", "128",
    "--post-self-attn-layernorm", "--post-mlp-layernorm", "--rotary-interleaved", "--rotary-percent", "0.5",
    "--no-rope-fusion", "--untie-embeddings-and-output-weights",
]
SP = ["--sequence-parallel"]
LAYOUTS = {  # name: TP, world, attention, flags
    "tp1": (1, 1, "local", []), "tp1_sdpa": (1, 1, "sdpa", []), "tp2_sp": (2, 2, "local", SP),
    "tp2_sp_sdpa": (2, 2, "sdpa", SP), "dp2": (1, 2, "sdpa", []),
    "pp2": (1, 2, "sdpa", ["--pipeline-model-parallel-size", "2"]),
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, Path]:
    return tiny_with_torch_dist("glm4", tmp_path_factory.mktemp("glm4"))


@pytest.fixture(scope="module")
def results(tiny, tmp_path_factory) -> dict[str, dict]:
    return run_layouts(tiny, tmp_path_factory.mktemp("runs"), LAYOUTS, GLM4_FLAGS)


def test_log_probs_equal_hf(tiny, results) -> None:
    assert_log_probs_equal_hf(tiny[0], results)


def test_one_step_is_the_same_in_every_layout(results) -> None:
    for name in LAYOUTS:
        if name != "tp1":
            assert_same_step(results["tp1"], results[name], name)


def test_post_norms_train_and_every_hf_weight_is_published(tiny, results) -> None:
    model, _ = tiny
    with safe_open(str(model / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert {f"model.layers.1.{norm}.weight" for norm in ("post_self_attn_layernorm", "post_mlp_layernorm")} <= names
    for name, result in results.items():
        assert set(result["weights"]) == names, f"{name}: {set(result['weights']) ^ names}"


def _check(model: Path, flags: list[str], config: dict | None = None) -> None:
    argv = ["--hf-checkpoint", str(model), "--num-rollout", "1", "--debug-train-only", "--n-samples-per-prompt", "2",
            "--load-debug-rollout-data", "x", *flags]
    check_model_flags(build_config(build_parser().parse_args(argv)).shape, str(model),
                      config or json.loads((model / "config.json").read_text()))


def test_flags_that_do_not_fit_the_checkpoint_are_named(tiny, tmp_path: Path) -> None:
    model, _ = tiny
    _check(model, GLM4_FLAGS)  # slime's pass
    qwen3 = make_tiny_hf("qwen3", tmp_path / "qwen3", tied=False)
    with pytest.raises(ArgsError) as err:
        _check(qwen3, ["--post-mlp-layernorm", "--rotary-interleaved"])
    assert {line.split(" disagrees with")[0] for line in err.value.problems} == {
        "--post-mlp-layernorm True", "--rotary-interleaved True"}
    with pytest.raises(ArgsError, match=r"--spec slime_plugins.models.glm4 get_glm_spec builds GlmForCausalLM, "
                                        r"Glm4ForCausalLM layers, but .* is a Qwen3ForCausalLM: drop --spec"):
        _check(qwen3, ["--spec", "slime_plugins.models.glm4", "get_glm_spec"])
    with pytest.raises(ArgsError, match=r"--spec slime_plugins.models.qwen3_next get_qwen3_next_spec builds "
                                        r"Qwen3NextForCausalLM layers, but .* is a Glm4ForCausalLM: drop --spec"):
        _check(model, ["--spec", "slime_plugins.models.qwen3_next", "get_qwen3_next_spec"])
    with pytest.raises(ArgsError, match=r"--spec slime_plugins.models.qwen3_5 get_qwen3_5_spec builds "
                                        r"Qwen3_5ForCausalLM, .* layers, but .* is a Glm4ForCausalLM: drop --spec"):
        _check(model, ["--spec", "slime_plugins.models.qwen3_5", "get_qwen3_5_spec"])
    with pytest.raises(ArgsError, match=r"--spec my_plugins.layers get_spec: custom layer specs are not supported; "
                                        r"slurmrl builds .*GLM-4 \(and GLM-4-0414\)"):
        _check(model, ["--spec", "my_plugins.layers", "get_spec"])


def test_every_version_reaches_the_engine_in_the_rl_loop(tmp_path: Path) -> None:
    """Over a weight-update group (gloo on the CPU): every tensor by its HF name, the post norms too (disk
    publishing does not depend on the family)."""
    assert_rl_loop_on_policy("glm4", GLM4_FLAGS, tmp_path, "nccl")


def assert_rl_loop_on_policy(arch: str, flags: list[str], tmp_path: Path, transport: str) -> None:
    """Three rollouts of `python -m trainer` with `flags` on a tiny `arch`, served by a stand-in engine behind the
    router: each published version reaches the engine intact (its log-probs the trainer's: on policy)."""
    model = tiny_hf_with_tokenizer(arch, tmp_path / "models", seed=0)
    data = write_toy_data(tmp_path / "toy.jsonl", num_prompts=32)
    servers = tmp_path / "servers"
    servers.mkdir()
    with engines_behind_router(model, servers, count=1, deterministic=True) as (router, _):
        trainer((model, data), router, tmp_path / "job", "--num-rollout", "3", "--rollout-batch-size", "8",
                "--lr", "1e-2", "--train-backend", "megatron", "--update-weight-transport", transport,
                *flags,
                "--true-on-policy-mode", "--true-on-policy-tolerance", str(SAME_CPU))
    rows = metrics(tmp_path / "job")
    assert [m["rollout_id"] for m in rows] == [0, 1, 2]
    assert all(m["logp_mismatch_max"] < SAME_CPU and m["engines_updated"] == 1 for m in rows), rows
