"""The one place where Hugging Face names and layouts meet Megatron GPTModel's torch_dist ones.

Used by the converter (both directions) and by the trainer's weight publishing. Megatron stacks
each per-layer weight over layers (a leading [num_layers] axis; experts add a second one); a rule
says how one layer's (or one expert's) Megatron slice is built from HF tensors, and back.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ckpt_tools.architectures import (
    DENSE_GLM_ARCHITECTURES,
    EXPERT_BIAS_ARCHITECTURES,
    MINIMAX_ARCHITECTURES,
    MLA_ARCHITECTURES,
    MOE_ARCHITECTURES,
    MTP_ARCHITECTURES,
    POST_NORM_ARCHITECTURES,
    QK_NORM_ARCHITECTURES,
    QKV_BIAS_GLM_ARCHITECTURES,
    QWEN3_5_ARCHITECTURES,
    QWEN3_5_BLOCKER,
    QWEN3_NEXT_ARCHITECTURES,
    SUPPORTED_ARCHITECTURES,
    check_deepseek_v3,
    check_expert_bias_moe,
    check_minimax_m2,
    check_qwen3_next,
    declared_mtp_layers,
    dense_first_layers,
    linear_attention_layers,
    routed_experts,
)
from ckpt_tools.rope import gpt_rope_kwargs, mla_rope_kwargs


@dataclass(frozen=True)
class MLAShape:
    """DeepSeek's multi-latent attention (config.json names); q_lora_rank None: a plain q_proj."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int


@dataclass(frozen=True)
class ModelShape:
    """What the mapping needs to know of an HF config."""

    architecture: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    padded_vocab_size: int
    tied_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    num_experts: int  # 0 for dense models
    mla: MLAShape | None = None
    shared_experts: bool = False
    expert_bias: bool = False  # the router's e_score_correction_bias (DeepSeek-V3's aux-loss-free balancing)
    dense_layers: int = 0  # DeepSeek's first_k_dense_replace: the first layers' MLP is dense (intermediate_size)
    # Multi-token prediction layers kept (--mtp-num-layers): megatron's mtp.layers.K, HF's decoder layer
    # num_layers + K (a MoE layer with its own norms and input projection)
    mtp_layers: int = 0
    # The dense GLM-4s: HF fuses gate_proj and up_proj into mlp.gate_up_proj (megatron's linear_fc1 layout),
    # rotates interleaved pairs, and (GLM-4-0414) normalises the attention's and the MLP's outputs
    fused_gate_up: bool = False
    rotary_interleaved: bool = False
    post_norms: bool = False
    # MiniMax-M2: q/k norms over all heads' dimensions at once, and Mixtral's checkpoint names for the MoE
    full_qk_norm: bool = False
    mixtral_names: bool = False
    # Qwen3-Next: these layers' token mixer is a gated delta net (ckpt_tools.gated_delta_net, copied by HF's
    # names); the others' attention output is gated (HF's q_proj gives each head's query, then its gate);
    # one shared expert (HF's shared_expert) scaled by a sigmoid gate; zero-centred norms
    linear_attention_layers: tuple[int, ...] = ()
    attention_output_gate: bool = False
    shared_expert_gate: bool = False
    zero_centered_norms: bool = False

    @classmethod
    def from_hf_config(cls, config: dict, make_vocab_size_divisible_by: int = 1, mtp_layers: int = 0) -> ModelShape:
        archs = config.get("architectures") or []
        arch = archs[0] if archs else "(none)"
        if arch in QWEN3_5_ARCHITECTURES:
            raise ValueError(f"config.json architectures: {arch} is not supported: {QWEN3_5_BLOCKER}")
        if len(archs) > 1 or arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"config.json architectures: {', '.join(archs) or arch} is not supported; "
                             f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        glm = arch in QKV_BIAS_GLM_ARCHITECTURES
        # GLM's attention_bias is on q, k and v only (Qwen2's qkv bias)
        for flag in ("mlp_bias", "use_sliding_window") if glm else ("attention_bias", "mlp_bias", "use_sliding_window"):
            if config.get(flag):
                raise ValueError(f"config.json: {flag}=true is not supported for {arch}")
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"config.json: hidden_act {config['hidden_act']!r} is not supported (only silu)")
        heads = config["num_attention_heads"]
        kv_heads = config.get("num_key_value_heads") or heads
        if heads % kv_heads:
            raise ValueError(f"config.json: num_attention_heads ({heads}) is not a multiple of "
                             f"num_key_value_heads ({kv_heads})")
        experts = routed_experts(config)
        mixed = config.get("mlp_only_layers") or config.get("decoder_sparse_step", 1) != 1
        if arch == "Qwen3MoeForCausalLM" and mixed:
            raise ValueError("config.json: mlp_only_layers / decoder_sparse_step mix dense and MoE layers, "
                             "which is not supported; every layer must be MoE")
        deepseek = arch in MLA_ARCHITECTURES
        expert_bias = arch in EXPERT_BIAS_ARCHITECTURES
        if expert_bias:
            check_expert_bias_moe(config)
        if deepseek:
            check_deepseek_v3(config)
        minimax = arch in MINIMAX_ARCHITECTURES
        if minimax:
            check_minimax_m2(config)
        qwen3_next = arch in QWEN3_NEXT_ARCHITECTURES
        if qwen3_next:
            check_qwen3_next(config)
        (mla_rope_kwargs if deepseek else gpt_rope_kwargs)(config)  # a RoPE megatron-core computes as transformers
        if mtp_layers and arch not in MTP_ARCHITECTURES:
            raise ValueError(f"--mtp-num-layers {mtp_layers}: {arch} has no multi-token prediction layers; "
                             f"those that do: {', '.join(MTP_ARCHITECTURES)}")
        if mtp_layers > declared_mtp_layers(config):
            raise ValueError(f"num_nextn_predict_layers is {declared_mtp_layers(config)}, below --mtp-num-layers "
                             f"{mtp_layers}: the checkpoint must hold every MTP layer trained")
        vocab = config["vocab_size"]
        multiple = max(1, make_vocab_size_divisible_by)
        return cls(
            architecture=arch,
            num_layers=config["num_hidden_layers"],
            hidden_size=config["hidden_size"],
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=config["qk_nope_head_dim"] + config["qk_rope_head_dim"] if deepseek
            else config.get("head_dim") or config["hidden_size"] // heads,
            vocab_size=vocab,
            padded_vocab_size=-(-vocab // multiple) * multiple,
            tied_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=arch == "Qwen2ForCausalLM" or (glm and bool(config.get("attention_bias"))),
            qk_norm=arch in QK_NORM_ARCHITECTURES or (glm and bool(config.get("use_qk_norm"))),
            num_experts=experts if arch in MOE_ARCHITECTURES else 0,
            mla=MLAShape(config.get("q_lora_rank"), config["kv_lora_rank"], config["qk_nope_head_dim"],
                         config["qk_rope_head_dim"], config["v_head_dim"]) if deepseek else None,
            shared_experts=(expert_bias and bool(config.get("n_shared_experts"))) or qwen3_next,
            expert_bias=expert_bias,
            dense_layers=dense_first_layers(config) if expert_bias else 0,
            mtp_layers=mtp_layers,
            fused_gate_up=arch in DENSE_GLM_ARCHITECTURES,
            rotary_interleaved=arch in DENSE_GLM_ARCHITECTURES,
            post_norms=arch in POST_NORM_ARCHITECTURES,
            full_qk_norm=minimax,
            mixtral_names=minimax,
            linear_attention_layers=linear_attention_layers(config),
            attention_output_gate=qwen3_next,
            shared_expert_gate=qwen3_next,
            zero_centered_norms=qwen3_next,
        )

    @property
    def layers_differ(self) -> bool:
        """Whether megatron keys each layer apart (dense and MoE ones mixed, or linear and full attention)."""
        return bool(self.dense_layers or self.linear_attention_layers)

    @property
    def first_full_attention_layer(self) -> int:
        return next(i for i in range(self.num_layers) if i not in self.linear_attention_layers)

    def moe_layer_pattern(self) -> list[int]:
        """Megatron's --moe-layer-freq as a per-layer list: 1 for a MoE layer, 0 for a dense one."""
        return [0] * self.dense_layers + [1] * (self.num_layers - self.dense_layers)


# How one Megatron slice relates to its HF tensors.
COPY, QKV, GATE_UP, VOCAB = "copy", "qkv", "gate_up", "vocab"


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
        return head + _layer_rules(shape, moe=bool(shape.num_experts)) + tail + _mtp_rules(shape)
    kinds = {(moe, linear): _layer_rules(shape, moe=bool(moe), linear=linear) for moe in (0, 1)
             for linear in (False, True)}
    return head + [_in_layer(rule, layer) for layer, moe in enumerate(shape.moe_layer_pattern())
                   for rule in kinds[moe, layer in shape.linear_attention_layers]] + tail + _mtp_rules(shape)


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
        out += [Rule(f"decoder.layers.self_attention.{name}", (f"model.layers.{{l}}.{name}",)) for name in (
            "input_layernorm.weight", *(f"linear_attn.{p}" for p in (
                "in_proj_qkvz.weight", "in_proj_ba.weight", "conv1d.weight", "dt_bias", "A_log", "norm.weight",
                "out_proj.weight")))]
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
    # The local spec stores the pre-MLP norm under the dense MLP's name (a MoE layer's too), but not with MLA.
    norm = Rule("decoder.layers.pre_mlp_layernorm.weight" if shape.mla
                else "decoder.layers.mlp.linear_fc1.layer_norm_weight",
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
