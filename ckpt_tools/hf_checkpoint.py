"""Read a Hugging Face checkpoint lazily (safetensors, single file or sharded with an index) and
check that its config and weights agree before anything is converted."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch
from safetensors import safe_open

from ckpt_tools.architectures import GATED_DELTA_NET_ARCHITECTURES, mtp_layer_prefixes
from ckpt_tools.mapping import Rule, rules
from ckpt_tools.model_shape import ModelShape
from ckpt_tools.qwen3_5_config import language_model_config

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# Weights HF checkpoints may carry that the model does not need.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# A multimodal checkpoint's vision tower: not converted (slurmrl trains the language model)
VISION_PREFIX = "model.visual."
FUSED_EXPERTS_SUFFIX = ".mlp.experts.gate_up_proj"
_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


class CheckpointError(ValueError):
    """A checkpoint that cannot be converted; the message names the file or field and the fix."""


class HFCheckpoint:
    """Tensor names, shapes and dtypes from the safetensors headers; data only when asked for."""

    def __init__(self, hf_dir: Path, make_vocab_size_divisible_by: int = 1, mtp_layers: int = 0) -> None:
        self.dir = Path(hf_dir)
        config_path = self.dir / "config.json"
        if not config_path.is_file():
            raise CheckpointError(f"{config_path} not found: --hf must be a Hugging Face model folder")
        try:
            self.config = language_model_config(json.loads(config_path.read_text()))
            self.shape = ModelShape.from_hf_config(self.config, make_vocab_size_divisible_by, mtp_layers)
        except (json.JSONDecodeError, KeyError) as err:
            raise CheckpointError(f"{config_path}: cannot read {err}") from None
        except ValueError as err:
            raise CheckpointError(f"{config_path}: {err}") from None
        self.weight_map = self._weight_map()
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.dtypes: dict[str, torch.dtype] = {}
        for file in sorted(set(self.weight_map.values())) or [SINGLE]:
            self._read_header(file)
        if any(name.endswith(FUSED_EXPERTS_SUFFIX) for name in self.shapes):
            self.shape = replace(self.shape, fused_experts=True)
        self._check_against_config()

    def _weight_map(self) -> dict[str, str]:
        index = self.dir / INDEX
        if index.is_file():
            return json.loads(index.read_text())["weight_map"]
        if (self.dir / SINGLE).is_file():
            return {}  # filled from the single file's header
        raise CheckpointError(f"{self.dir} holds neither {SINGLE} nor {INDEX}: only safetensors checkpoints convert")

    def _read_header(self, file: str) -> None:
        path = self.dir / file
        if not path.is_file():
            raise CheckpointError(f"shard {path} is listed in {INDEX} but missing")
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    sl = f.get_slice(name)
                    self.shapes[name] = tuple(sl.get_shape())
                    self.dtypes[name] = _DTYPES.get(sl.get_dtype(), torch.float32)
                    self.weight_map.setdefault(name, file)
        except Exception as err:  # safetensors raises its own error types for damaged files
            raise CheckpointError(f"{path} is damaged or truncated ({err}); re-download or re-save it") from None
        size = path.stat().st_size
        if size < _data_end(path):
            raise CheckpointError(f"{path} is truncated ({size} bytes, header needs {_data_end(path)})")

    def _check_against_config(self) -> None:
        s = self.shape
        expected = {
            s.hf_prefix + "embed_tokens.weight": (s.vocab_size, s.hidden_size),
            **_attention_shapes(s, f"{s.hf_prefix}layers.{s.first_full_attention_layer}.self_attn."),
            **_linear_attention_shapes(self.config, s),
            **_fused_expert_shapes(self.config, s),
            s.hf_prefix + "norm.weight": (s.hidden_size,),
        }
        needed = set()
        for rule in rules(s):
            for name in self.names_of(rule):
                needed.add(name)
                if name not in self.shapes:
                    raise CheckpointError(f"weights lack {name}, which config.json ({s.architecture}, "
                                          f"{s.num_layers} layers) requires: config and weights disagree")
        for name, want in expected.items():
            if self.shapes[name] != want:
                raise CheckpointError(f"config.json and weights disagree: {name} is {list(self.shapes[name])}, "
                                      f"the config implies {list(want)}")
        # The MTP layers config.json declares beyond those kept are described, and left out; so are the tensors
        # slurmrl never converts.
        left_out = (*mtp_layer_prefixes(self.config, kept=s.mtp_layers), *unconverted_prefixes(s))
        extra = sorted(n for n in self.shapes if n not in needed and not n.endswith(IGNORED_SUFFIXES)
                       and not (s.tied_embeddings and n == "lm_head.weight")
                       and not (left_out and n.startswith(left_out)))
        if extra:
            raise CheckpointError(f"weights hold {len(extra)} tensors config.json does not describe "
                                  f"(e.g. {', '.join(extra[:3])}): config and weights disagree")

    def mtp_layers_held(self) -> int:
        """How many of the MTP layers config.json declares the weights hold (each has its input
        projection): a checkpoint may declare them and leave them out, as transformers' saves do."""
        return sum(1 for prefix in mtp_layer_prefixes(self.config) if f"{prefix}eh_proj.weight" in self.shapes)

    def names_of(self, rule: Rule) -> list[str]:
        """Every HF tensor name a rule reads, over all layers and experts."""
        layers = range(self.shape.num_layers) if rule.per_layer else [None]
        experts = range(self.shape.num_experts) if rule.per_expert else [None]
        return [n for layer in layers for e in experts for n in rule.hf_names(layer, e)]

    def read(self, names: list[str]) -> list[torch.Tensor]:
        """Load these tensors (each file opened per call, so threads may read in parallel)."""
        out = []
        for name in names:
            with safe_open(str(self.dir / self.weight_map[name]), framework="pt") as f:
                out.append(f.get_tensor(name))
        return out


def unconverted_prefixes(shape: ModelShape) -> tuple[str, ...]:
    """The HF names of what slurmrl never converts (torch_dist -> HF writes them back from the original checkpoint,
    ckpt_tools.original_checkpoint): a multimodal checkpoint's vision tower, Qwen3-Next's and Qwen3.5's mtp. module."""
    return (*((VISION_PREFIX,) if shape.hf_prefix != "model." else ()),
            *(("mtp.",) if shape.architecture in GATED_DELTA_NET_ARCHITECTURES else ()))


def _attention_shapes(s: ModelShape, attn: str) -> dict[str, tuple[int, ...]]:
    """The attention projections' shapes the config implies."""
    if s.mla is None:  # a gated attention's q_proj gives each head's query, then its gate
        gated = 2 if s.attention_output_gate else 1
        return {attn + "q_proj.weight": (gated * s.num_heads * s.head_dim, s.hidden_size),
                attn + "k_proj.weight": (s.num_kv_heads * s.head_dim, s.hidden_size),
                attn + "o_proj.weight": (s.hidden_size, s.num_heads * s.head_dim)}
    m = s.mla
    q = ({attn + "q_a_proj.weight": (m.q_lora_rank, s.hidden_size),
          attn + "q_b_proj.weight": (s.num_heads * s.head_dim, m.q_lora_rank)} if m.q_lora_rank
         else {attn + "q_proj.weight": (s.num_heads * s.head_dim, s.hidden_size)})
    return {**q, attn + "kv_a_proj_with_mqa.weight": (m.kv_lora_rank + m.qk_rope_head_dim, s.hidden_size),
            attn + "kv_b_proj.weight": (s.num_heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank),
            attn + "o_proj.weight": (s.hidden_size, s.num_heads * m.v_head_dim)}


def _linear_attention_shapes(config: dict, s: ModelShape) -> dict[str, tuple[int, ...]]:
    """The first gated delta net layer's projections' shapes the config implies (Qwen3-Next's fused, or
    Qwen3.5's apart)."""
    if not s.linear_attention_layers:
        return {}
    gdn = f"{s.hf_prefix}layers.{s.linear_attention_layers[0]}.linear_attn."
    key = config["linear_num_key_heads"] * config["linear_key_head_dim"]
    value = config["linear_num_value_heads"] * config["linear_value_head_dim"]
    heads = config["linear_num_value_heads"]
    projections = ({"in_proj_qkv": 2 * key + value, "in_proj_z": value, "in_proj_b": heads, "in_proj_a": heads}
                   if s.split_gdn_projections else {"in_proj_qkvz": 2 * key + 2 * value, "in_proj_ba": 2 * heads})
    return {**{f"{gdn}{name}.weight": (rows, s.hidden_size) for name, rows in projections.items()},
            gdn + "conv1d.weight": (2 * key + value, 1, config["linear_conv_kernel_dim"]),
            gdn + "out_proj.weight": (s.hidden_size, value)}


def _fused_expert_shapes(config: dict, s: ModelShape) -> dict[str, tuple[int, ...]]:
    """The first MoE layer's fused experts' shapes the config implies (each expert's gate and up rows, its down)."""
    if not s.fused_experts:
        return {}
    experts, width = f"{s.hf_prefix}layers.{s.dense_layers}.mlp.experts.", config["moe_intermediate_size"]
    return {experts + "gate_up_proj": (s.num_experts, 2 * width, s.hidden_size),
            experts + "down_proj": (s.num_experts, s.hidden_size, width)}


def _data_end(path: Path) -> int:
    """Where the last tensor's bytes end, from the safetensors header."""
    with open(path, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(header_len))
    ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
    return 8 + header_len + max(ends, default=0)
