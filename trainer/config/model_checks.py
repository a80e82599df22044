"""The checks that read --hf-checkpoint's config.json: parallel layouts the model allows, and
model-shape flags that must equal the config's values."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import Any

from ckpt_tools.architectures import (
    BUILT_FAMILIES,
    BUILT_SPECS,
    MTP_ARCHITECTURES,
    declared_mtp_layers,
    routed_experts,
)
from ckpt_tools.qwen3_5_config import language_model_config
from trainer.args_parser import MTP_LOSS_SCALE, ArgsError
from trainer.config.sections import ShapeFlags
from trainer.model_flags import MODEL_FLAGS, UNCHECKED

Need = Callable[[bool, str], object]  # records or raises a failed check
# config.json fields a flag's expected value is computed from, named in a disagreement
_DERIVED_FROM = {"moe_layer_freq": ("first_k_dense_replace", "num_hidden_layers")}


def read_hf_config(hf_checkpoint: str) -> dict[str, Any]:
    """--hf-checkpoint's config.json (build_config checked that there is one), a multimodal one's language model
    read as its own (ckpt_tools.qwen3_5_config; ArgsError naming a field it cannot read so)."""
    try:
        return language_model_config(json.loads((Path(hf_checkpoint) / "config.json").read_text()))
    except ValueError as err:
        raise ArgsError(f"--hf-checkpoint {hf_checkpoint}/{err}") from None


def check_mtp(args: argparse.Namespace, config: dict[str, Any] | None, need: Need) -> None:
    """slime's multi-token prediction flags against the backend, the layout and config.json."""
    layers = args.mtp_num_layers
    need(not args.enable_mtp_training or layers, "--enable-mtp-training needs --mtp-num-layers N (the MTP layers "
                                                 "to train)")
    need(args.enable_mtp_training or args.mtp_loss_scaling_factor == MTP_LOSS_SCALE,
         "--mtp-loss-scaling-factor weighs the loss of --enable-mtp-training: add it or drop the flag")
    if layers is None:
        return
    if not need(layers >= 1, f"--mtp-num-layers must be 1 or more, got {layers}"):
        return
    need(args.train_backend == "megatron", f"--mtp-num-layers {layers} needs --train-backend megatron (the fsdp "
                                           "backend trains transformers' model, which has no MTP layers)")
    need(args.pipeline_model_parallel_size == 1 and args.context_parallel_size == 1,
         f"--mtp-num-layers {layers}: MTP layers under pipeline or context parallelism are not supported; "
         "use tensor, expert and data parallelism")
    if config is None:
        return
    arch, families = (config.get("architectures") or ["(none)"])[0], ", ".join(MTP_ARCHITECTURES)
    if need(arch in MTP_ARCHITECTURES, f"--mtp-num-layers {layers}: {args.hf_checkpoint} is a {arch}, which has "
                                       f"no multi-token prediction layers (those that do: {families})"):
        need(layers <= declared_mtp_layers(config), f"--mtp-num-layers {layers}: {args.hf_checkpoint}/config.json "
             f"has num_nextn_predict_layers {declared_mtp_layers(config)}; the checkpoint must hold every MTP layer "
             "trained")


def _squashed(name: str) -> str:
    """A model name as slime compares --model-name (its default: the config class's name, lower case)."""
    return name.lower().replace("_", "").replace("-", "").removesuffix("config")


def check_spec(args: argparse.Namespace, config: dict[str, Any] | None, need: Need) -> None:
    """slime's --spec MODULE FUNCTION: accepted where slurmrl builds those layers itself for config.json's model;
    slime's --model-name (which picks its megatron-to-HF converter): accepted where it names config.json's
    model_type, whose converter slurmrl picks anyway."""
    model_type = (config or {}).get("model_type")
    need(args.model_name is None or config is None or _squashed(str(model_type)) == _squashed(args.model_name),
         f"--model-name {args.model_name}: {args.hf_checkpoint}'s config.json has model_type {model_type}; slurmrl "
         "converts weights as config.json says: drop --model-name")
    if args.spec is None:
        return
    spec = " ".join(args.spec)
    archs = BUILT_SPECS.get(tuple(args.spec))
    if not need(archs is not None, f"--spec {spec}: custom layer specs are not supported; slurmrl builds "
                                   f"{BUILT_FAMILIES} models from --hf-checkpoint's config.json"):
        return
    assert archs is not None
    arch = (config.get("architectures") or ["(none)"])[0] if config else None
    need(arch is None or arch in archs, f"--spec {spec} builds {', '.join(archs)} layers, but {args.hf_checkpoint} "
                                        f"is a {arch}: drop --spec (slurmrl builds the layers from config.json)")


def validate_megatron_parallel(args: argparse.Namespace, config: dict[str, Any], need: Need) -> None:
    tp, etp = args.tensor_model_parallel_size, args.expert_tensor_parallel_size
    need(etp is None or (etp >= 1 and tp % etp == 0),
         f"--expert-tensor-parallel-size {etp} must be 1 or more and divide --tensor-model-parallel-size {tp}")
    _validate_pipeline_stages(args, config.get("num_hidden_layers"), need)
    pp = args.pipeline_model_parallel_size
    moe = bool(routed_experts(config))
    need(not moe or pp == 1 or args.moe_token_dispatcher_type == "alltoall", f"--pipeline-model-parallel-size {pp} "
         "with a MoE model needs --moe-token-dispatcher-type alltoall (GPU): megatron-core's allgather dispatcher "
         "does not support the variable sequence lengths pipeline stages exchange")
    need(not moe or tp == 1 or args.sequence_parallel or args.train_backend != "megatron",
         f"--tensor-model-parallel-size {tp} with a MoE model needs --sequence-parallel (megatron-core's MoE layer "
         "requires it when training with TP > 1)")


def _validate_pipeline_stages(args: argparse.Namespace, layers: Any, need: Need) -> None:
    """As megatron: the first and last stages take the layers given them, the stages between
    share the rest evenly."""
    pp, first, last = (args.pipeline_model_parallel_size, args.decoder_first_pipeline_num_layers,
                       args.decoder_last_pipeline_num_layers)
    given = [f for f, n in (("--decoder-first-pipeline-num-layers", first),
                            ("--decoder-last-pipeline-num-layers", last)) if n is not None]
    need(not given or pp > 1, f"{given[0] if given else ''} needs --pipeline-model-parallel-size > 1")
    if pp == 1:
        return
    need(all(n is None or n >= 1 for n in (first, last)), "--decoder-first/last-pipeline-num-layers must be 1 or more")
    rest, middle = layers - (first or 0) - (last or 0), pp - (first is not None) - (last is not None)
    need(rest >= 0 and (rest % middle == 0 if middle else rest == 0), f"--pipeline-model-parallel-size {pp} "
         f"cannot split the model's {layers} layers: with {first} in the first stage and {last} in the last "
         "(none given: an even split), the other stages must share the rest evenly")


def check_model_flags(shape: ShapeFlags, hf_checkpoint: str, hf_config: dict[str, Any]) -> None:
    """Every model-shape flag that was given must equal the HF config's value, and the model
    has no dropout (train_step's log-probs must be those of log_probs for the same weights):
    ArgsError with every problem."""
    problems = model_flag_problems({f.name: getattr(shape, f.name) for f in fields(shape)}, hf_checkpoint, hf_config)
    if problems:
        raise ArgsError(*problems)


def model_flag_problems(given_flags: dict[str, Any], hf_checkpoint: str, hf_config: dict[str, Any]) -> list[str]:
    """check_model_flags' problems, one line each; given_flags: each model-shape flag's value (None: not given)."""
    problems = []
    dropout = hf_config.get("attention_dropout", 0.0)
    if dropout:
        problems.append(f"{hf_checkpoint}/config.json has attention_dropout {dropout}: dropout is not supported "
                        "in RL training; set it to 0.0")
    for flag, read in MODEL_FLAGS.items():
        given = given_flags[flag]
        if given is None:
            continue
        try:
            expected = read(hf_config)
        except (KeyError, IndexError, TypeError):
            problems.append(f"--{flag.replace('_', '-')} {given}: {hf_checkpoint}/config.json lacks the field "
                            "to check it against; drop the flag or fix the checkpoint")
            continue
        except ValueError as err:  # a config.json value slurmrl cannot build (ckpt_tools.rope): named once
            if not any(line.endswith(f"{hf_checkpoint}/{err}") for line in problems):
                problems.append(f"--{flag.replace('_', '-')} {given}: {hf_checkpoint}/{err}")
            continue
        if expected is not UNCHECKED and given != expected:
            source = "".join(f", {field} {hf_config[field]}" for field in _DERIVED_FROM.get(flag, ())
                             if field in hf_config)
            problems.append(f"--{flag.replace('_', '-')} {given} disagrees with {hf_checkpoint}/config.json "
                            f"({expected}{source}); drop the flag or fix the checkpoint")
    return problems
