"""The one place where Hugging Face names and layouts meet Megatron GPTModel's torch_dist ones.

Used by the converter (both directions) and by the trainer's weight publishing. Megatron stacks
each per-layer weight over layers (a leading [num_layers] axis; experts add a second one); a rule
says how one layer's (or one expert's) Megatron slice is built from HF tensors, and back.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ckpt_tools.model_shape import MLAShape, ModelShape

# How one Megatron slice relates to its HF tensors.
COPY, QKV, GATE_UP, VOCAB = "copy", "qkv", "gate_up", "vocab"
# The pre-MLP norm's key: a dense layer's (fused into its first linear) and a MoE or MLA layer's.
# slurmrl wrote a MoE layer's under the dense key before 2026-11-27: loads still read it (legacy_norm_key).
DENSE_NORM_KEY = "decoder.layers.mlp.linear_fc1.layer_norm_weight"
MOE_NORM_KEY = "decoder.layers.pre_mlp_layernorm.weight"


def legacy_norm_key(key: str) -> str | None:
    """The key slurmrl wrote a MoE layer's pre-MLP norm under before it keyed it as slime does, or None
    for any other key (a layer's keys may carry its number: decoder.layers.3.pre_mlp_layernorm.weight)."""
    moe_suffix, dense_suffix = (k.removeprefix("decoder.layers.") for k in (MOE_NORM_KEY, DENSE_NORM_KEY))
    return key.removesuffix(moe_suffix) + dense_suffix if key.endswith(moe_suffix) else None


@dataclass(frozen=True)
class Rule:
    """Megatron key `megatron` <- HF names `hf` ({l}: layer, {e}: expert) combined as `kind`."""

    megatron: str
    hf: tuple[str, ...]
    kind: str = COPY
    per_layer: bool = True
    per_expert: bool = False
    linear: bool = False  # Megatron keeps an _extra_state entry for each linear module
    # An HF tensor that repeats the Megatron one another rule reads (an MTP layer's own copy of the
    # embedding and of the output head): written to HF from it, never read from HF
    repeat: bool = False
    # One HF tensor holds every expert of the layer along its first axis (fused experts): one slice of the
    # megatron key stacked over experts, whose linear modules' extra state is still each expert's
    all_experts: bool = False

    def hf_names(self, layer: int | None = None, expert: int | None = None) -> list[str]:
        return [name.format(l=layer, e=expert) for name in self.hf]


def rules(shape: ModelShape) -> list[Rule]:
    """Every tensor of the model, in the order the converter writes them.

    Where dense and MoE layers mix (first_k_dense_replace), megatron keys each layer apart
    (decoder.layers.N.*, its TransformerBlock's non-homogeneous layers) instead of stacking them."""
    head = [Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), VOCAB, per_layer=False)]
    tail = [Rule("decoder.final_layernorm.weight", ("model.norm.weight",), per_layer=False)]
    if not shape.tied_embeddings:
        tail.append(Rule("output_layer.weight", ("lm_head.weight",), VOCAB, per_layer=False))
    if not shape.layers_differ:
        every = head + _layer_rules(shape, moe=bool(shape.num_experts)) + tail + _mtp_rules(shape)
    else:
        kinds = {(moe, linear): _layer_rules(shape, moe=bool(moe), linear=linear) for moe in (0, 1)
                 for linear in (False, True)}
        every = head + [_in_layer(rule, layer) for layer, moe in enumerate(_mlp_kinds(shape))
                        for rule in kinds[moe, layer in shape.linear_attention_layers]] + tail + _mtp_rules(shape)
    if shape.hf_prefix == "model.":
        return every
    # a multimodal checkpoint's language model: model.language_model.layers..., its lm_head where it was
    return [replace(rule, hf=tuple(shape.hf_prefix + name.removeprefix("model.") if name.startswith("model.") else name
                                   for name in rule.hf)) for rule in every]


def _mlp_kinds(shape: ModelShape) -> list[int]:
    """Each layer's MLP: 1 for the experts', 0 for a dense one."""
    return shape.moe_layer_pattern() if shape.num_experts else [0] * shape.num_layers


def _mtp_rules(shape: ModelShape) -> list[Rule]:
    """The MTP layers (DeepSeek-V3's layout): each a MoE decoder layer whose input is the projection
    of [norm(embedding of the next token); norm(hidden state)], its own final norm, and HF's copies
    of the embedding and the output head (megatron shares the model's own)."""
    out = []
    for k in range(shape.mtp_layers):
        layer = shape.num_layers + k
        hf, mega = f"model.layers.{layer}.", f"mtp.layers.{k}."
        out += [Rule(mega + "enorm.weight", (hf + "enorm.weight",), per_layer=False),
                Rule(mega + "hnorm.weight", (hf + "hnorm.weight",), per_layer=False),
                Rule(mega + "eh_proj.weight", (hf + "eh_proj.weight",), per_layer=False, linear=True)]
        out += [replace(rule, megatron=rule.megatron.replace("decoder.layers.", mega + "transformer_layer.", 1),
                        hf=tuple(name.replace("{l}", str(layer)) for name in rule.hf), per_layer=False)
                for rule in _layer_rules(shape, moe=True)]
        head = "embedding.word_embeddings.weight" if shape.tied_embeddings else "output_layer.weight"
        out += [Rule(mega + "final_layernorm.weight", (hf + "shared_head.norm.weight",), per_layer=False),
                Rule("embedding.word_embeddings.weight", (hf + "embed_tokens.weight",), VOCAB, per_layer=False,
                     repeat=True),
                Rule(head, (hf + "shared_head.head.weight",), VOCAB, per_layer=False, repeat=True)]
    return out


def _in_layer(rule: Rule, layer: int) -> Rule:
    """A per-layer rule made the rule of one layer (its key and HF names name it; no layer axis)."""
    return replace(rule, megatron=rule.megatron.replace("decoder.layers.", f"decoder.layers.{layer}.", 1),
                   hf=tuple(name.replace("{l}", str(layer)) for name in rule.hf), per_layer=False)


def _layer_rules(shape: ModelShape, moe: bool, linear: bool = False) -> list[Rule]:
    """One decoder layer's tensors (keys without the layer number): attention (a gated delta net when
    `linear`), then the MLP (the experts' when `moe`)."""
    attn = "model.layers.{l}.self_attn."
    mlp = "model.layers.{l}.mlp."
    # Mixtral's names (MiniMax-M2): the MoE under block_sparse_moe, each expert's gate, up and down as w1, w3, w2
    sparse = "model.layers.{l}.block_sparse_moe." if shape.mixtral_names else mlp
    gate, up, down = ("w1", "w3", "w2") if shape.mixtral_names else ("gate_proj", "up_proj", "down_proj")
    out = []
    if linear:  # slime's names: the layer's input norm and transformers' module, under self_attention
        projections = (("in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight")
                       if shape.split_gdn_projections else ("in_proj_qkvz.weight", "in_proj_ba.weight"))
        out += [Rule(f"decoder.layers.self_attention.{name}", (f"model.layers.{{l}}.{name}",)) for name in (
            "input_layernorm.weight", *(f"linear_attn.{p}" for p in (
                *projections, "conv1d.weight", "dt_bias", "A_log", "norm.weight", "out_proj.weight")))]
    elif shape.mla:
        out += _mla_rules(shape.mla)
    else:
        out += [
            Rule("decoder.layers.self_attention.linear_qkv.layer_norm_weight",
                 ("model.layers.{l}.input_layernorm.weight",)),
            Rule("decoder.layers.self_attention.linear_qkv.weight",
                 (attn + "q_proj.weight", attn + "k_proj.weight", attn + "v_proj.weight"), QKV, linear=True),
        ]
    if shape.qkv_bias:
        out.append(Rule("decoder.layers.self_attention.linear_qkv.bias",
                        (attn + "q_proj.bias", attn + "k_proj.bias", attn + "v_proj.bias"), QKV))
    if shape.qk_norm and not linear:  # MiniMax-M2's over all heads: slime's q_norm and k_norm (ckpt_tools.full_qk_norm)
        kind = "norm" if shape.full_qk_norm else "layernorm"
        out += [Rule(f"decoder.layers.self_attention.q_{kind}.weight", (attn + "q_norm.weight",)),
                Rule(f"decoder.layers.self_attention.k_{kind}.weight", (attn + "k_norm.weight",))]
    if not linear:
        out.append(Rule("decoder.layers.self_attention.linear_proj.weight", (attn + "o_proj.weight",), linear=True))
    if shape.post_norms:  # slime's megatron names them as HF does
        out.append(Rule("decoder.layers.post_self_attn_layernorm.weight",
                        ("model.layers.{l}.post_self_attn_layernorm.weight",)))
    # A dense layer's pre-MLP norm under its fused linear's name; a MoE layer's (which has no fused linear)
    # and MLA's under their own, as megatron's TransformerEngine spec (slime's) keys them (megatron_model.moe_norm_key)
    norm = Rule(MOE_NORM_KEY if shape.mla or moe else DENSE_NORM_KEY,
                ("model.layers.{l}.post_attention_layernorm.weight",))
    if moe:
        expert = sparse + "experts.{e}."
        out += [norm, Rule("decoder.layers.mlp.router.weight", (sparse + "gate.weight",))]
        if shape.expert_bias:  # Mixtral's names keep the bias beside the gate, not in it
            bias = sparse + ("" if shape.mixtral_names else "gate.") + "e_score_correction_bias"
            out.append(Rule("decoder.layers.mlp.router.expert_bias", (bias,)))
        if shape.shared_experts:
            shared = mlp + ("shared_expert." if shape.shared_expert_gate else "shared_experts.")
            out += [
                Rule("decoder.layers.mlp.shared_experts.linear_fc1.weight",
                     (shared + "gate_proj.weight", shared + "up_proj.weight"), GATE_UP, linear=True),
                Rule("decoder.layers.mlp.shared_experts.linear_fc2.weight", (shared + "down_proj.weight",),
                     linear=True),
            ]
        if shape.shared_expert_gate:
            out.append(Rule("decoder.layers.mlp.shared_experts.gate_weight", (mlp + "shared_expert_gate.weight",)))
        if shape.fused_experts:  # an expert's gate_up_proj rows are its linear_fc1 (gate rows, then up rows)
            out += [Rule(f"decoder.layers.mlp.experts.experts.linear_fc{i}.weight", (mlp + f"experts.{name}",),
                         linear=True, all_experts=True) for i, name in ((1, "gate_up_proj"), (2, "down_proj"))]
        else:
            out += [
                Rule("decoder.layers.mlp.experts.experts.linear_fc1.weight",
                     (expert + f"{gate}.weight", expert + f"{up}.weight"), GATE_UP, per_expert=True, linear=True),
                Rule("decoder.layers.mlp.experts.experts.linear_fc2.weight", (expert + f"{down}.weight",),
                     per_expert=True, linear=True),
            ]
    else:
        out += [
            norm,
            Rule("decoder.layers.mlp.linear_fc1.weight", (mlp + "gate_up_proj.weight",), linear=True)
            if shape.fused_gate_up else
            Rule("decoder.layers.mlp.linear_fc1.weight", (mlp + "gate_proj.weight", mlp + "up_proj.weight"),
                 GATE_UP, linear=True),
            Rule("decoder.layers.mlp.linear_fc2.weight", (mlp + "down_proj.weight",), linear=True),
        ]
    if shape.post_norms:
        out.append(Rule("decoder.layers.post_mlp_layernorm.weight", ("model.layers.{l}.post_mlp_layernorm.weight",)))
    return out


def _mla_rules(mla: MLAShape) -> list[Rule]:
    """Multi-latent attention: every projection keeps HF's layout (per head: no-RoPE part, then
    RoPE part; K before V), so each tensor is copied; the local spec keeps the input norm apart."""
    attn, mega = "model.layers.{l}.self_attn.", "decoder.layers.self_attention."
    out = [Rule("decoder.layers.input_layernorm.weight", ("model.layers.{l}.input_layernorm.weight",))]
    if mla.q_lora_rank:
        out += [Rule(mega + "linear_q_down_proj.weight", (attn + "q_a_proj.weight",), linear=True),
                Rule(mega + "q_layernorm.weight", (attn + "q_a_layernorm.weight",)),
                Rule(mega + "linear_q_up_proj.weight", (attn + "q_b_proj.weight",), linear=True)]
    else:
        out.append(Rule(mega + "linear_q_proj.weight", (attn + "q_proj.weight",), linear=True))
    return out + [Rule(mega + "linear_kv_down_proj.weight", (attn + "kv_a_proj_with_mqa.weight",), linear=True),
                  Rule(mega + "kv_layernorm.weight", (attn + "kv_a_layernorm.weight",)),
                  Rule(mega + "linear_kv_up_proj.weight", (attn + "kv_b_proj.weight",), linear=True)]


def to_megatron(rule: Rule, tensors: list[torch.Tensor], shape: ModelShape) -> torch.Tensor:
    """Build one Megatron slice (without the stacking axes) from its HF tensors."""
    if rule.kind == COPY:
        return tensors[0]
    if rule.kind == GATE_UP:
        return torch.cat(tensors, dim=0)
    if rule.kind == VOCAB:
        (table,) = tensors
        pad = shape.padded_vocab_size - table.shape[0]
        return torch.cat([table, table.new_zeros(pad, *table.shape[1:])]) if pad else table
    q, k, v = tensors  # QKV: per KV group, that group's query heads (then their gates), its key, its value
    groups, per_group, d = shape.num_kv_heads, shape.num_heads // shape.num_kv_heads, shape.head_dim
    trailing = q.shape[1:]
    if shape.attention_output_gate:  # HF: each head's query, then its gate
        q = q.reshape(groups, per_group, 2, d, *trailing).transpose(1, 2)
        per_group *= 2
    return torch.cat([
        q.reshape(groups, per_group * d, *trailing),
        k.reshape(groups, d, *trailing),
        v.reshape(groups, d, *trailing),
    ], dim=1).reshape(-1, *trailing)


def to_hf(rule: Rule, tensor: torch.Tensor, shape: ModelShape) -> list[torch.Tensor]:
    """Split one Megatron slice back into its HF tensors (the inverse of to_megatron)."""
    if rule.kind == COPY:
        return [tensor]
    if rule.kind == GATE_UP:
        return list(tensor.chunk(2, dim=0))
    if rule.kind == VOCAB:
        return [tensor[: shape.vocab_size]]
    groups, per_group, d = shape.num_kv_heads, shape.num_heads // shape.num_kv_heads, shape.head_dim
    gated = 2 if shape.attention_output_gate else 1
    trailing = tensor.shape[1:]
    q, k, v = tensor.reshape(groups, (gated * per_group + 2) * d, *trailing).split([gated * per_group * d, d, d], dim=1)
    if gated == 2:
        q = q.reshape(groups, 2, per_group, d, *trailing).transpose(1, 2)
    return [q.reshape(-1, *trailing), k.reshape(-1, *trailing), v.reshape(-1, *trailing)]


def hf_slice_shapes(rule: Rule, shape: ModelShape, hf_shapes: list[tuple[int, ...]]) -> tuple[int, ...]:
    """The shape of one Megatron slice, computed from its HF tensors' shapes without loading them."""
    if rule.kind == COPY:
        return hf_shapes[0]
    if rule.kind == VOCAB:
        return (shape.padded_vocab_size, *hf_shapes[0][1:])
    return (sum(s[0] for s in hf_shapes), *hf_shapes[0][1:])


def stacking(rule: Rule, shape: ModelShape) -> tuple[int, ...]:
    """The leading axes Megatron stacks this key over: (), (layers,), (experts,) or (layers, experts)."""
    return (*((shape.num_layers,) if rule.per_layer else ()), *((shape.num_experts,) if rule.per_expert else ()))
