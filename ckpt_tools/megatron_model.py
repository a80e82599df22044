"""Megatron-core GPTModel built from a Hugging Face config, torch_dist loading, and logits.

Used by the checkpoint tools (verify) and their tests; runs on CPU (gloo) through
`ckpt_tools.megatron_compat`, and on GPU unchanged.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.core.dist_checkpointing import ShardedTensor
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.validation import StrictHandling
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel import ColumnParallelLinear
from megatron.core.transformer import MLATransformerConfig, TransformerConfig
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.multi_token_prediction import (
    MultiTokenPredictionBlockSubmodules,
    MultiTokenPredictionLayer,
    MultiTokenPredictionLayerSubmodules,
)
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    LayerNormImpl,
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from ckpt_tools import megatron_compat
from ckpt_tools.architectures import expert_ffn_size
from ckpt_tools.full_qk_norm import FullQKNormSelfAttention
from ckpt_tools.gated_delta_net import gated_delta_net_layer
from ckpt_tools.gated_delta_rule import GdnBackend
from ckpt_tools.mapping import legacy_norm_key
from ckpt_tools.mla_attention import MLADotProductAttention
from ckpt_tools.model_shape import ModelShape
from ckpt_tools.mtp_model import MTPGPTModel
from ckpt_tools.post_norm_layer import with_post_norms
from ckpt_tools.qwen3_5_config import language_model_config
from ckpt_tools.qwen3_next_norms import ZeroCenteredNorm
from ckpt_tools.rope import gpt_rope_kwargs, mla_rope_kwargs
from ckpt_tools.torch_dist import read_metadata

megatron_compat.apply()


def _moe_kwargs(hf_config: dict, shape: ModelShape) -> dict[str, Any]:
    common = {
        "num_moe_experts": shape.num_experts,
        "moe_ffn_hidden_size": expert_ffn_size(hf_config),
        "moe_router_topk": hf_config["num_experts_per_tok"],
        "moe_aux_loss_coeff": 0.0,
        "moe_router_load_balancing_type": "none",
        # alltoall creates a torch.cuda.Stream; grouped GEMM needs the grouped_gemm package.
        "moe_token_dispatcher_type": "allgather",
        "moe_grouped_gemm": False,
        # DeepSeek's first_k_dense_replace: the first layers' MLP is dense (megatron's --moe-layer-freq list)
        "moe_layer_freq": shape.moe_layer_pattern() if shape.dense_layers else 1,
    }
    if shape.expert_bias:  # DeepSeek-V3: sigmoid scores, bias-corrected grouped top-k, scaled weights
        return {**common, **_expert_bias_router_kwargs(hf_config)}
    if shape.shared_expert_gate:  # Qwen3-Next: one shared expert, scaled by sigmoid(gate . x)
        common.update(moe_shared_expert_intermediate_size=hf_config["shared_expert_intermediate_size"],
                      moe_shared_expert_gate=True)
    return {
        **common,
        "moe_router_score_function": "softmax",
        # norm_topk_prob: softmax over the top-k logits; otherwise softmax over all, then top-k.
        "moe_router_pre_softmax": not hf_config.get("norm_topk_prob", False),
    }


def _expert_bias_router_kwargs(hf_config: dict) -> dict[str, Any]:
    """transformers' DeepseekV3TopkRouter (Glm4Moe's too) as megatron-core's (mapping.check_expert_bias_moe
    made sure they agree); the bias starts at the checkpoint's e_score_correction_bias."""
    groups = hf_config.get("n_group") or 1
    shared = hf_config.get("n_shared_experts") or 0
    return {
        "moe_router_score_function": "sigmoid",
        "moe_router_enable_expert_bias": True,
        "moe_router_num_groups": groups if groups > 1 else None,
        "moe_router_group_topk": hf_config.get("topk_group") if groups > 1 else None,
        "moe_router_topk_scaling_factor": hf_config.get("routed_scaling_factor", 1.0),
        "moe_shared_expert_intermediate_size": shared * hf_config["moe_intermediate_size"] if shared else None,
    }


def _gated_delta_net_kwargs(hf_config: dict, shape: ModelShape) -> dict[str, Any]:
    """Qwen3-Next's linear-attention layers, in megatron-core's fields (linear_attention_freq: 1 for a gated
    delta net layer); megatron-core's experimental_attention_variant stays off: ckpt_tools.gated_delta_net
    builds them."""
    return {
        "linear_attention_freq": [int(i in shape.linear_attention_layers) for i in range(shape.num_layers)],
        **{field: hf_config[field] for field in ("linear_conv_kernel_dim", "linear_key_head_dim",
                                                 "linear_value_head_dim", "linear_num_key_heads",
                                                 "linear_num_value_heads")},
    }


def _mla_kwargs(hf_config: dict, shape: ModelShape) -> dict[str, Any]:
    """MLATransformerConfig's fields, its RoPE (plain or YaRN) included."""
    assert shape.mla is not None
    mla = shape.mla
    return {
        "multi_latent_attention": True,
        "q_lora_rank": mla.q_lora_rank,
        "kv_lora_rank": mla.kv_lora_rank,
        "qk_head_dim": mla.qk_nope_head_dim,
        "qk_pos_emb_head_dim": mla.qk_rope_head_dim,
        "v_head_dim": mla.v_head_dim,
        # q_a_layernorm and kv_a_layernorm are the local spec's q/kv layernorms.
        "qk_layernorm": True,
        **mla_rope_kwargs(hf_config),
    }


def transformer_config_from_hf(
    hf_config: dict, tp: int = 1, ep: int = 1, make_vocab_size_divisible_by: int = 128,
    params_dtype: torch.dtype = torch.float32, sequence_parallel: bool = False, etp: int | None = None,
    cp: int = 1, pp: int = 1, pp_first: int | None = None, pp_last: int | None = None, mtp_layers: int = 0,
) -> tuple[TransformerConfig, dict[str, Any]]:
    """TransformerConfig and GPTModel keyword arguments (besides config and layer spec).

    The config is validated, and its shape derived, by ckpt_tools.mapping.ModelShape; the vocab
    is padded as Megatron-LM does, to a multiple of make_vocab_size_divisible_by * tp.
    sequence_parallel needs tp > 1 and SP-capable norms (trainer.megatron.norm); etp (expert
    tensor parallel size) defaults to tp, as in megatron."""
    hf_config = language_model_config(hf_config)
    shape = ModelShape.from_hf_config(hf_config, make_vocab_size_divisible_by * tp, mtp_layers)
    config_kwargs: dict[str, Any] = {
        "num_layers": shape.num_layers,
        "hidden_size": shape.hidden_size,
        "ffn_hidden_size": hf_config["intermediate_size"],
        "num_attention_heads": shape.num_heads,
        "num_query_groups": shape.num_kv_heads,
        "kv_channels": shape.head_dim,
        "normalization": "RMSNorm",
        "layernorm_epsilon": hf_config.get("rms_norm_eps", 1e-6),
        "gated_linear_unit": True,
        "activation_func": F.silu,
        "add_bias_linear": False,
        "add_qkv_bias": shape.qkv_bias,
        "rotary_interleaved": shape.rotary_interleaved,
        "qk_layernorm": shape.qk_norm,
        "hidden_dropout": 0.0,
        "attention_dropout": hf_config.get("attention_dropout", 0.0),
        "init_method_std": hf_config.get("initializer_range", 0.02),
        "tensor_model_parallel_size": tp,
        "expert_model_parallel_size": ep,
        "expert_tensor_parallel_size": etp,
        "sequence_parallel": sequence_parallel,
        "context_parallel_size": cp,
        "pipeline_model_parallel_size": pp,
        # Stages exchange activations in the parameters' dtype.
        "pipeline_dtype": params_dtype if pp > 1 else None,
        "num_layers_in_first_pipeline_stage": pp_first,
        "num_layers_in_last_pipeline_stage": pp_last,
        "use_cpu_initialization": not torch.cuda.is_available(),
        "params_dtype": params_dtype,
        "bf16": params_dtype == torch.bfloat16,
        "fp16": params_dtype == torch.float16,
        "mtp_num_layers": mtp_layers or None,
        "attention_output_gate": shape.attention_output_gate,
        "layernorm_zero_centered_gamma": shape.zero_centered_norms,
    }
    if shape.linear_attention_layers:
        config_kwargs.update(_gated_delta_net_kwargs(hf_config, shape))
    if shape.num_experts:
        config_kwargs.update(_moe_kwargs(hf_config, shape))
    config_class = TransformerConfig
    if shape.mla:
        config_class = MLATransformerConfig
        config_kwargs.update(_mla_kwargs(hf_config, shape))
    model_kwargs = {
        "vocab_size": shape.padded_vocab_size,
        "max_sequence_length": hf_config.get("max_position_embeddings", 4096),
        "share_embeddings_and_output_weights": shape.tied_embeddings,
        # MLA's layers build their own RoPE from the config (above)
        **({"position_embedding_type": "rope"} if shape.mla else gpt_rope_kwargs(hf_config)),
    }
    return config_class(**config_kwargs), model_kwargs


def build_gpt_model(
    hf_config: dict, tp: int = 1, ep: int = 1, make_vocab_size_divisible_by: int = 128,
    params_dtype: torch.dtype = torch.float32, spec: ModuleSpec | None = None, mtp_layers: int = 0,
) -> GPTModel:
    """A GPTModel (no TransformerEngine) for this rank of an initialised TP/EP grid, with the given
    layer spec (say trainer.megatron.attention.gpt_layer_spec(...)); default: megatron's local spec
    (its dense variant for the dense layers of a model that mixes them with MoE ones); with
    `mtp_layers` MTP layers (ckpt_tools.mtp_model).

    The HF vocab size is kept as `model.hf_vocab_size` so logits can drop the padding."""
    hf_config = language_model_config(hf_config)
    config, model_kwargs = transformer_config_from_hf(hf_config, tp, ep, make_vocab_size_divisible_by, params_dtype,
                                                      mtp_layers=mtp_layers)
    shape = ModelShape.from_hf_config(hf_config)
    norm = ZeroCenteredNorm if config.layernorm_zero_centered_gamma else LayerNormImpl

    def local_spec(num_experts: int | None) -> ModuleSpec:
        layer = spec or get_gpt_layer_local_spec(
            num_experts=num_experts, moe_grouped_gemm=False, qk_layernorm=config.qk_layernorm,
            normalization="RMSNorm", multi_latent_attention=config.multi_latent_attention,
        )
        attention = layer.submodules.self_attention.submodules
        if config.multi_latent_attention and attention.core_attention is DotProductAttention:
            attention.core_attention = MLADotProductAttention
        if shape.full_qk_norm and spec is None:
            layer.submodules.self_attention.module = FullQKNormSelfAttention
        if config.layernorm_zero_centered_gamma and spec is None:
            layer.submodules.input_layernorm = layer.submodules.pre_mlp_layernorm = norm
            attention.q_layernorm = attention.k_layernorm = norm
        return with_post_norms(layer, LayerNormImpl) if shape.post_norms and spec is None else layer

    layers = stage_layer_specs(config, local_spec, split_gdn=shape.split_gdn_projections)
    # One layer spec: megatron repeats it (and picks the final norm); layers of several kinds: the block's list.
    mixed = isinstance(config.moe_layer_freq, list) or isinstance(config.linear_attention_freq, list)
    block = TransformerBlockSubmodules(layer_specs=layers, layer_norm=norm) if mixed else layers[0]
    mtp_layer = local_spec(config.num_moe_experts)
    model = with_mtp_layers(config, block, moe_norm_key(mtp_layer) if config.num_moe_experts else mtp_layer, norm,
                            model_kwargs, hf_config["vocab_size"])
    if torch.cuda.is_available():  # the torch norms of the local spec are built on the CPU whatever the config says
        model = model.to(torch.device("cuda", torch.cuda.current_device()))
    model.hf_vocab_size = hf_config["vocab_size"]
    return model


def with_mtp_layers(config: TransformerConfig, block: ModuleSpec | TransformerBlockSubmodules, mtp_layer: ModuleSpec,
                    norm: type, model_kwargs: dict[str, Any], hf_vocab_size: int, **kwargs: Any) -> GPTModel:
    """The GPTModel of `block`; with config.mtp_num_layers, an MTPGPTModel whose MTP layers are
    `mtp_layer`s (the decoder's MoE layer, as DeepSeek-V3's) with `norm`s (the decoder's own: megatron's
    spec would take its torch norm, which refuses sequence parallelism)."""
    if not config.mtp_num_layers:
        return GPTModel(config=config, transformer_layer_spec=block, **model_kwargs, **kwargs)
    layer = ModuleSpec(module=MultiTokenPredictionLayer, submodules=MultiTokenPredictionLayerSubmodules(
        enorm=norm, hnorm=norm, eh_proj=ColumnParallelLinear, transformer_layer=mtp_layer, layer_norm=norm))
    mtp = MultiTokenPredictionBlockSubmodules(layer_specs=[layer] * config.mtp_num_layers)
    return MTPGPTModel(config=config, transformer_layer_spec=block, mtp_block_spec=mtp, hf_vocab_size=hf_vocab_size,
                       **model_kwargs, **kwargs)


def stage_layer_specs(config: TransformerConfig, layer_spec: Callable[[int | None], ModuleSpec],
                      gdn_backend: GdnBackend = "torch", split_gdn: bool = False) -> list[ModuleSpec]:
    """The spec of each of this pipeline stage's layers: layer_spec(config.num_moe_experts) for a
    MoE layer (or any layer of a model without a dense/MoE mix), layer_spec(None) for a dense one,
    as megatron's moe_layer_freq list says (get_gpt_decoder_layer_specs, for local specs); its token
    mixer a gated delta net (with the `gdn_backend` kernel; `split_gdn`: Qwen3.5's projections) where the
    linear_attention_freq list says 1."""
    freq, linear = config.moe_layer_freq, config.linear_attention_freq
    kinds = list(zip(freq if isinstance(freq, list) else [1] * config.num_layers,
                     linear if isinstance(linear, list) else [0] * config.num_layers))
    specs = {}
    for moe, gdn in sorted(set(kinds)):
        spec = layer_spec(config.num_moe_experts if moe else None)
        spec = moe_norm_key(spec) if moe and config.num_moe_experts else spec
        specs[moe, gdn] = gated_delta_net_layer(spec, gdn_backend, split_gdn) if gdn else spec
    offset = get_transformer_layer_offset(config)
    return [specs[kind] for kind in kinds[offset: offset + get_num_layers_to_build(config)]]


def moe_norm_key(layer: ModuleSpec) -> ModuleSpec:
    """A MoE layer's spec with its pre-MLP norm stored under its own name (mapping.MOE_NORM_KEY), as
    megatron's TransformerEngine spec (slime's) stores it: the local spec stores it under the dense
    MLP's fused linear, which a MoE layer does not have."""
    layer = copy.deepcopy(layer)
    keys = layer.submodules.sharded_state_dict_keys_map
    layer.submodules.sharded_state_dict_keys_map = {k: v for k, v in keys.items() if k != "pre_mlp_layernorm."}
    return layer


def with_legacy_norm_keys(sharded_state_dict: dict[str, Any], ckpt_dir: str | os.PathLike) -> dict[str, Any]:
    """The model's sharded state dict, with each tensor that a checkpoint slurmrl wrote before
    2026-11-27 keeps under another key (a MoE layer's pre-MLP norm: mapping.legacy_norm_key) asked
    for under that key. The optimizer's keys, made from the model's, follow."""
    stored = read_metadata(Path(ckpt_dir)).state_dict_metadata
    for value in nested_values(sharded_state_dict):
        if isinstance(value, ShardedTensor) and value.key not in stored:
            legacy = legacy_norm_key(value.key)
            if legacy is not None and legacy in stored:
                value.key = legacy
    return sharded_state_dict


# Megatron-LM keeps these non-model states in the same .distcp files; a model load skips them.
# Megatron-LM also keeps optimizer and RNG state, and in common.pt the iteration, version and args.
_NON_MODEL_PREFIXES = ("optimizer", "rng_state", "iteration", "checkpoint_version", "args",
                       "num_floating_point_operations_so_far", "opt_param_scheduler")


def load_torch_dist(model: GPTModel, ckpt_dir: str | os.PathLike) -> None:
    """Load a torch_dist checkpoint directory (the iter_* folder) into this rank's shard of `model`.

    Strict both ways: a model tensor absent from the checkpoint, or a checkpoint model tensor
    the model has no place for (say output_layer.weight into tied embeddings), raises."""
    state_dict, in_ckpt_only, in_model_only = dist_checkpointing.load(
        with_legacy_norm_keys(model.sharded_state_dict(), ckpt_dir), str(ckpt_dir), strict=StrictHandling.RETURN_ALL)
    in_ckpt_only = {k for k in in_ckpt_only if not k.startswith(_NON_MODEL_PREFIXES)}
    # common.pt's entries come back merged into the state dict: they are not the model's.
    state_dict = {k: v for k, v in state_dict.items() if not k.startswith(_NON_MODEL_PREFIXES)}
    problems = [f"{what} {sorted(keys)}" for what, keys in (
        ("the checkpoint lacks", in_model_only), ("the model has no place for", in_ckpt_only)) if keys]
    if problems:
        raise RuntimeError(f"checkpoint {ckpt_dir} does not match the model: {'; '.join(problems)}")
    result = model.load_state_dict(state_dict, strict=False)
    if result.missing_keys or result.unexpected_keys:
        raise RuntimeError(f"state dict from {ckpt_dir} does not fit the model: missing "
                           f"{result.missing_keys}, unexpected {result.unexpected_keys}")


@torch.no_grad()
def megatron_logits(model: GPTModel, input_ids: torch.Tensor) -> torch.Tensor:
    """Full-vocabulary logits [B, S, V] (gathered over TP, padding trimmed), on the CPU wherever the
    model runs, to compare with a reference there; call on every TP rank."""
    model.eval()
    input_ids = input_ids.to(next(model.parameters()).device)
    batch, seq = input_ids.shape
    position_ids = torch.arange(seq, device=input_ids.device).expand(batch, seq)
    # True = masked. Megatron's default causal mask would be allocated on "cuda".
    causal_mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool, device=input_ids.device), diagonal=1)
    logits = model(input_ids, position_ids, causal_mask[None, None], runtime_gather_output=True)
    return logits[..., : getattr(model, "hf_vocab_size", logits.shape[-1])].cpu()


def init_parallel(tp: int = 1, ep: int = 1, seed: int = 1234, etp: int | None = None, cp: int = 1,
                  pp: int = 1) -> None:
    """Initialise torch.distributed (unless already up) and megatron's TP/EP (and expert-TP,
    default tp), CP and PP groups and RNG.

    Uses env:// when WORLD_SIZE is set (torchrun, srun wrappers), else a lone process."""
    if not torch.distributed.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():
            # SLURM may already have narrowed CUDA_VISIBLE_DEVICES to this task's GPU.
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
        if "WORLD_SIZE" in os.environ:
            torch.distributed.init_process_group(backend)
        else:
            torch.distributed.init_process_group(backend, store=torch.distributed.HashStore(), rank=0, world_size=1)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                             expert_tensor_parallel_size=etp, context_parallel_size=cp,
                                             pipeline_model_parallel_size=pp)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def destroy_parallel() -> None:
    """Undo init_parallel (megatron groups, then the default process group)."""
    parallel_state.destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
