"""slime's own recipes, unchanged but for paths, pass `slurmrl submit --dry-run` and describe the
job they ask for. The argument lists are slime's scripts verbatim (tests/jobs/slime_recipes/); the
models are config.json stand-ins with the real models' shapes; the data are tiny files."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from ckpt_tools.qwen3_5_config import language_model_config
from contract.spec_loading import load_spec
from jobs import sglang_args, submit_cli, validate
from trainer.args import build_parser

RECIPES = Path(__file__).parent / "slime_recipes"

_QWEN3 = {"hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 1000000, "vocab_size": 151936,
          "head_dim": 128, "max_position_embeddings": 40960, "attention_bias": False}
CONFIGS = {  # the shape-bearing fields of each model's config.json on the Hugging Face hub
    "Qwen3-4B": {**_QWEN3, "architectures": ["Qwen3ForCausalLM"], "hidden_size": 2560, "intermediate_size": 9728,
                 "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
                 "tie_word_embeddings": True},
    "Qwen3-30B-A3B": {**_QWEN3, "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 2048,
                      "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48,
                      "num_attention_heads": 32, "num_key_value_heads": 4, "num_experts": 128,
                      "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1,
                      "mlp_only_layers": [], "tie_word_embeddings": False},
    "Qwen3-32B": {**_QWEN3, "architectures": ["Qwen3ForCausalLM"], "hidden_size": 5120, "intermediate_size": 25600,
                  "num_hidden_layers": 64, "num_attention_heads": 64, "num_key_value_heads": 8,
                  "tie_word_embeddings": False},
    "Qwen2.5-0.5B-Instruct": {"architectures": ["Qwen2ForCausalLM"], "hidden_act": "silu", "hidden_size": 896,
                              "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
                              "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
                              "vocab_size": 151936, "max_position_embeddings": 32768, "tie_word_embeddings": True},
}
_DEEPSEEK = {"architectures": ["DeepseekV3ForCausalLM"], "hidden_act": "silu", "hidden_size": 7168,
             "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
             "num_experts_per_tok": 8, "n_shared_experts": 1, "norm_topk_prob": True, "rms_norm_eps": 1e-6,
             "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
             "v_head_dim": 128, "attention_bias": False, "tie_word_embeddings": False}
CONFIGS |= {
    "DeepSeek-R1": {**_DEEPSEEK, "num_attention_heads": 128, "num_key_value_heads": 128, "n_routed_experts": 256,
                    "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5, "first_k_dense_replace": 3,
                    "vocab_size": 129280, "max_position_embeddings": 163840, "rope_theta": 10000,
                    "rope_scaling": {"type": "yarn", "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                                     "beta_fast": 32, "beta_slow": 1, "original_max_position_embeddings": 4096}},
    "Kimi-K2-Instruct": {**_DEEPSEEK, "num_attention_heads": 64, "num_key_value_heads": 64, "n_routed_experts": 384,
                         "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.827, "first_k_dense_replace": 1,
                         "vocab_size": 163840, "max_position_embeddings": 131072, "rope_theta": 50000.0,
                         "rope_scaling": {"type": "yarn", "factor": 32.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                                          "beta_fast": 1.0, "beta_slow": 1.0, "original_max_position_embeddings": 4096}},
}

CONFIGS["Qwen3-Next-80B-A3B-Thinking"] = {  # Qwen/Qwen3-Next-80B-A3B-Thinking's config.json, shape fields
    "architectures": ["Qwen3NextForCausalLM"], "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 5120,
    "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
    "partial_rotary_factor": 0.25, "rope_theta": 10000000, "rms_norm_eps": 1e-6, "vocab_size": 151936,
    "max_position_embeddings": 262144, "attention_bias": False, "tie_word_embeddings": False,
    "num_experts": 512, "num_experts_per_tok": 10, "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "full_attention_interval": 4, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32}

# Qwen3.5's checkpoints are multimodal: the language model's fields under text_config (what slime's flags give, and
# Qwen3.5's rotary); the gated delta nets' widths (no flag gives them) are Qwen3_5TextConfig's defaults
_QWEN3_5_TEXT = {"hidden_act": "silu", "head_dim": 256, "rms_norm_eps": 1e-6, "vocab_size": 248320,
                 "max_position_embeddings": 262144, "attention_bias": False, "tie_word_embeddings": False,
                 "attn_output_gate": True, "full_attention_interval": 4, "linear_conv_kernel_dim": 4,
                 "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_num_key_heads": 16,
                 "linear_num_value_heads": 32, "model_type": "qwen3_5_text",
                 "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                                     "mrope_interleaved": True, "mrope_section": [11, 11, 10]}}


def _qwen3_5(**text: object) -> dict:
    return {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
            "tie_word_embeddings": False, "text_config": {**_QWEN3_5_TEXT, **text},
            "vision_config": {"model_type": "qwen3_5_vision", "depth": 27, "hidden_size": 1152}}


CONFIGS["Qwen3.5-27B"] = _qwen3_5(hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
                                  num_attention_heads=24, num_key_value_heads=4, linear_num_value_heads=48)
CONFIGS["models/Qwen3.5-9B"] = _qwen3_5(hidden_size=4096, intermediate_size=12288, num_hidden_layers=32,
                                        num_attention_heads=16, num_key_value_heads=4)
CONFIGS["Qwen3.5-35B-A3B"] = {**_qwen3_5(hidden_size=2048, num_hidden_layers=40, num_attention_heads=16,
                                          num_key_value_heads=2, num_experts=256, num_experts_per_tok=8,
                                          moe_intermediate_size=512, shared_expert_intermediate_size=512,
                                          model_type="qwen3_5_moe_text"),
                               "architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe"}


def _recipe_argv(name: str, root: Path, num_gpus: int = 8) -> list[str]:
    """The recipe's train.py arguments, expanded by bash exactly as slime's script expands them."""
    out = subprocess.run(["bash", "-c", f'source "{RECIPES / name}.sh" && printf "%s\\0" "${{ARGS[@]}}"'],
                         capture_output=True, text=True, check=True,
                         env={**os.environ, "ROOT": str(root), "NUM_GPUS": str(num_gpus)})
    return out.stdout.split("\0")[:-1]


def _files(root: Path) -> None:
    """What the recipes' paths point at: the models, torch_dist folders and prompt sets."""
    for model, config in CONFIGS.items():
        (root / model).mkdir(parents=True)
        (root / model / "config.json").write_text(json.dumps(config))
        (root / f"{model}_torch_dist").mkdir()
    (root / "Kimi-K2_torch_dist").mkdir()  # run-kimi-k2-Instruct's --ref-load
    row = {"prompt": [{"role": "user", "content": "1 + 1?"}], "label": "2"}
    for path in ("dapo-math-17k/dapo-math-17k.jsonl", "aime-2024/aime-2024.jsonl", "rl_data/aime-2024.jsonl",
                 "datasets/dapo-math-17k/dapo-math-17k.jsonl"):
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(json.dumps(row) + "\n")
    import pyarrow
    import pyarrow.parquet

    (root / "gsm8k").mkdir()
    for split in ("train", "test"):
        table = pyarrow.table({"messages": [[{"role": "user", "content": "1 + 1?"}]], "label": ["2"]})
        pyarrow.parquet.write_table(table, root / "gsm8k" / f"{split}.parquet")


@pytest.fixture
def root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    _files(tmp_path)
    # No cluster: capacity is checked only where SLURM answers, and this test asks no SLURM.
    monkeypatch.setattr(validate, "query_partitions", lambda timeout_s: None)
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("recipe, tp, sp, ep, gpus_per_engine", [
    ("run-qwen3-4B", 2, True, 1, 2),
    ("run-qwen3-30B-A3B", 4, True, 8, 8),
    ("run-qwen3-32B", 8, True, 1, 8),
    ("run-qwen2.5-0.5B-reproducibility", 1, True, 1, 1),
])
def test_a_slime_recipe_passes_dry_run_and_describes_its_job(root: Path, recipe: str, tp: int, sp: bool, ep: int,
                                                             gpus_per_engine: int,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    argv = _recipe_argv(recipe, root)
    assert submit_cli.main(argv + ["--dry-run"]) == 0, capsys.readouterr().err
    script = capsys.readouterr().out
    # --colocate: one group (no "#SBATCH hetjob" separator), the engines on the trainer's 8 GPUs of one node
    assert "#SBATCH hetjob" not in script and "#SBATCH --gres=gpu:8" in script and "#SBATCH --nodes=1" in script

    spec, problems = load_spec(None, argv)
    assert problems == []
    assert spec.rollout.colocate and spec.rollout.rollout_num_gpus_per_engine == gpus_per_engine
    args = build_parser().parse_args(spec.trainer.train_args)
    assert (args.tensor_model_parallel_size, args.sequence_parallel, args.expert_model_parallel_size) == (tp, sp, ep)
    assert args.eval_interval == 20 and len(args.eval_prompt_data) == 2  # one named eval set: NAME PATH
    if recipe != "run-qwen2.5-0.5B-reproducibility":
        assert args.use_dynamic_batch_size and args.recompute_granularity == "full"
        assert args.balance_data and args.rm_type == "deepscaler"


@pytest.mark.parametrize("flag, value, message", [
    ("--hidden-dropout", "0.1", "--hidden-dropout 0.1: dropout is not supported in RL training; use 0.0"),
    ("--num-layers", "35", "--num-layers 35 disagrees with"),
    ("--rotary-base", "10000", "--rotary-base 10000.0 disagrees with"),
])
def test_a_recipe_with_a_changed_value_is_refused_with_its_reason(root: Path, flag: str, value: str, message: str,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    argv = _recipe_argv("run-qwen3-4B", root)
    argv[argv.index(flag) + 1] = value
    assert submit_cli.main(argv + ["--dry-run"]) == 2
    assert message in capsys.readouterr().err


def test_slimes_fully_async_example_passes_as_train_async(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """examples/fully_async's 0.5B script: `python3 train_async.py ARGS` -> `slurmrl submit
    train_async.py ARGS`; its --rollout-function-path selects the fully asynchronous rollout."""
    argv = _recipe_argv("run-qwen2.5-0.5B-fully_async", root, num_gpus=4)
    assert submit_cli.main(["train_async.py", *argv, "--dry-run"]) == 0, capsys.readouterr().err
    script = capsys.readouterr().out
    assert "#SBATCH hetjob" in script, "the engines have GPUs of their own (no --colocate)"
    spec, problems = load_spec(None, [*argv, "--train-async"])
    assert problems == [] and (spec.trainer.actor_num_gpus_per_node, spec.rollout.rollout_num_gpus) == (1, 3)
    from trainer.args import build_parser
    from trainer.config.sections import FULLY_ASYNC_ROLLOUT

    args = build_parser().parse_args(spec.trainer.train_args)
    assert args.train_async and args.rollout_function_path == FULLY_ASYNC_ROLLOUT and args.num_rollout == 3


# What slime's DeepSeek-V3 and Kimi-K2 recipes give that slurmrl refuses for reasons of its own, not the
# model's shape: megatron's DeepEP dispatcher (flex).
_OTHER_REFUSALS = (("--moe-enable-deepep", 0, None), ("--moe-token-dispatcher-type", 1, "flex"))  # flag, values, value


def _without(args: list[str], flag: str, values: int, value: str | None) -> list[str]:
    i = next(i for i, a in enumerate(args) if a == flag and (value is None or args[i + 1] == value))
    return args[:i] + args[i + 1 + values:]


@pytest.mark.parametrize("recipe, model, dense", [("run-deepseek-r1", "DeepSeek-R1", 3),
                                                  ("run-kimi-k2-Instruct", "Kimi-K2-Instruct", 1)])
def test_deepseek_and_kimi_recipes_model_flags_agree_with_config_json(root: Path, recipe: str, model: str, dense: int,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """slime's DeepSeek-V3 and Kimi-K2 model flags (scripts/models/*.sh: MLA, shared experts, sigmoid
    grouped expert-bias routing, --moe-layer-freq [0]*K+[1]*(61-K)) agree with the real models' config.json,
    first_k_dense_replace included, YaRN's --rotary-scaling-factor and mscales too; the recipe itself is
    refused at submission for DeepEP; a --moe-layer-freq that disagrees with first_k_dense_replace is named with it."""
    from trainer.config.model_checks import model_flag_problems
    from trainer.config.sections import ShapeFlags

    argv = _recipe_argv(recipe, root)
    assert submit_cli.main(argv + ["--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "dispatcher needs the deep_ep package and CUDA" in err, err
    assert "mscale" not in err and "rotary" not in err, "YaRN is built from config.json"

    spec, _ = load_spec(None, argv)
    train_args = list(spec.trainer.train_args)
    for refused in _OTHER_REFUSALS:
        train_args = _without(train_args, *refused)
    args = build_parser().parse_args(train_args)
    assert args.moe_layer_freq == [0] * dense + [1] * (61 - dense)
    given = {name: getattr(args, name) for name in ShapeFlags.__dataclass_fields__}
    config = CONFIGS[model]
    assert model_flag_problems(given, str(root / model), config) == []
    (problem,) = model_flag_problems(given, str(root / model), {**config, "first_k_dense_replace": dense + 1})
    assert problem.startswith(f"--moe-layer-freq [0]*{dense}+[1]*{61 - dense} disagrees with {root / model}/config.json "
                              f"([0]*{dense + 1}+[1]*{60 - dense}, first_k_dense_replace {dense + 1}, "
                              "num_hidden_layers 61)"), problem


@pytest.mark.parametrize("recipe, model", [("run-qwen3-next-80B-A3B", "Qwen3-Next-80B-A3B-Thinking"),
                                           ("run-qwen3.5-35B-A3B-sft", "Qwen3.5-35B-A3B")])
def test_the_qwen3_next_recipes_model_flags_agree_with_config_json(root: Path, recipe: str, model: str,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """slime's Qwen3-Next-80B-A3B and Qwen3.5-35B-A3B model flags (their --spec, gated attention, zero-centred
    norms, a quarter of each head rotated, 512 or 256 experts with a gated shared expert) agree with the model's
    config.json (Qwen3.5's text_config); the recipe itself is refused at submission for DeepEP alone; a flag that
    disagrees is named."""
    from trainer.config.model_checks import model_flag_problems, read_hf_config
    from trainer.config.sections import ShapeFlags

    argv = _recipe_argv(recipe, root)
    assert submit_cli.main(argv + ["--dry-run"]) == 2
    (err,) = capsys.readouterr().err.splitlines()
    assert "flex: megatron's flex dispatcher runs on DeepEP" in err, err
    spec, _ = load_spec(None, argv)
    train_args = list(spec.trainer.train_args)
    for refused in _OTHER_REFUSALS:
        train_args = _without(train_args, *refused)
    args = build_parser().parse_args(train_args)
    given = {name: getattr(args, name) for name in ShapeFlags.__dataclass_fields__}
    config = read_hf_config(str(root / model))
    assert model_flag_problems(given, str(root / model), config) == []
    (problem,) = model_flag_problems(given, str(root / model), {**config, "num_experts": 64})
    assert problem.startswith(f"--num-experts {config['num_experts']} disagrees with") and "(64)" in problem, problem


def test_the_qwen3_5_recipes_pass_dry_run(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """examples/fully_async's Qwen3.5-9B passes as slime's Qwen3 recipes do, and so does slime's Qwen3.5-27B recipe
    (its --spec slime_plugins.models.qwen3_5 get_qwen3_5_spec, TP4 + SP, PP2 with 30 layers in the last stage,
    CP4, colocated on 4 nodes) but for its --attention-backend flash, which slurmrl's context-parallel attention
    lacks, and its --sglang-mamba-scheduler-strategy, which the pinned SGLang's parser (scripts/install.sh) does not
    know; every model flag is checked against the multimodal config.json's text_config, and one
    that disagrees is named."""
    from trainer.config.model_checks import model_flag_problems
    from trainer.config.sections import ShapeFlags

    async_argv = _recipe_argv("run-qwen3.5-9B-fully_async", root)
    assert submit_cli.main(["train_async.py", *async_argv, "--dry-run"]) == 0, capsys.readouterr().err
    assert "#SBATCH hetjob" in capsys.readouterr().out, "the engines have GPUs of their own (no --colocate)"

    argv = _recipe_argv("run-qwen3.5-27B", root)
    assert submit_cli.main(argv + ["--dry-run"]) == 2
    flash, *mamba = capsys.readouterr().err.splitlines()
    assert "--attention-backend flash: the megatron backend's context-parallel attention has no flash kernel" in flash
    # the recipe's engines need an SGLang newer than the one whose parser checks engine command lines here (where
    # scripts/install.sh put that parser: the device machine runs the suite without it)
    if (sglang_args.SIDE_FOLDER / "sglang").is_dir():
        assert len(mamba) == 1 and "SGLang refuses the engine command line: unrecognized arguments: " \
            "--mamba-scheduler-strategy" in mamba[0], mamba
    argv[argv.index("--attention-backend") + 1] = "auto"
    mamba_flag = argv.index("--sglang-mamba-scheduler-strategy")
    del argv[mamba_flag:mamba_flag + 2]
    assert submit_cli.main(argv + ["--dry-run"]) == 0, capsys.readouterr().err
    assert "#SBATCH --nodes=4" in capsys.readouterr().out
    spec, problems = load_spec(None, argv)
    assert problems == []
    args = build_parser().parse_args(spec.trainer.train_args)
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size,
            args.decoder_last_pipeline_num_layers) == (4, 2, 4, 30)
    given = {name: getattr(args, name) for name in ShapeFlags.__dataclass_fields__}
    text = CONFIGS["Qwen3.5-27B"]["text_config"]
    wrong = {**CONFIGS["Qwen3.5-27B"], "text_config": {**text, "rope_parameters": {
        **text["rope_parameters"], "partial_rotary_factor": 0.5}}}
    (problem,) = model_flag_problems(given, str(root / "Qwen3.5-27B"), language_model_config(wrong))
    assert problem.startswith("--rotary-percent 0.25 disagrees with"), problem
