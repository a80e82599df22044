"""Qwen3.5's config.json as the language model's fields, where slurmrl reads a model's shape.

A multimodal checkpoint (Qwen3_5ForConditionalGeneration, Qwen3_5MoeForConditionalGeneration) keeps them under
text_config, beside its vision tower's; and transformers' Qwen3.5 classes compute some things otherwise than a
field left out would say elsewhere: those are written out as the fields slurmrl reads."""

from __future__ import annotations

from typing import Any

from ckpt_tools.architectures import QWEN3_5_ARCHITECTURES, QWEN3_5_MOE_ARCHITECTURES

# Qwen3_5TextConfig's default where config.json gives none
_PARTIAL_ROTARY_FACTOR = 0.25


def language_model_config(config: dict[str, Any]) -> dict[str, Any]:
    """`config` unchanged for any other model (and for one already read so); for Qwen3.5 its text fields at the
    top (architectures and model_type the checkpoint's), with the values transformers computes by. ValueError
    where the multimodal config's tie_word_embeddings and its text_config's disagree."""
    archs = config.get("architectures") or [None]
    if archs[0] not in QWEN3_5_ARCHITECTURES:
        return config
    text = config.get("text_config") or {}
    out = {**config, **text, "architectures": archs, "model_type": config.get("model_type")}
    out.pop("text_config", None)
    out.pop("vision_config", None)
    ties = {where: c["tie_word_embeddings"] for where, c in (("", config), ("text_config.", text))
            if "tie_word_embeddings" in c}
    if len(set(ties.values())) > 1:
        raise ValueError(f"config.json: tie_word_embeddings {config['tie_word_embeddings']} and "
                         f"text_config.tie_word_embeddings {text['tie_word_embeddings']} disagree: transformers' "
                         "multimodal model reads the first, its language model alone the second; make them equal")
    rope = dict(out.get("rope_parameters") or {})
    if "partial_rotary_factor" not in rope and "partial_rotary_factor" not in out:
        out["rope_parameters"] = {**rope, "partial_rotary_factor": _PARTIAL_ROTARY_FACTOR}
    if archs[0] in QWEN3_5_MOE_ARCHITECTURES:
        # its router always normalises the top-k weights (the config class has no norm_topk_prob); every layer
        # is MoE, so megatron's dense width (intermediate_size, absent) is unused: an expert's, as slime's scripts
        if out.get("norm_topk_prob", True) is not True:
            raise ValueError(f"config.json: norm_topk_prob {out['norm_topk_prob']} is not supported: transformers' "
                             "Qwen3.5-MoE router always normalises the top-k weights")
        out["norm_topk_prob"] = True
        out.setdefault("intermediate_size", out.get("moe_intermediate_size"))
    return out
