"""The trained model's weights as Hugging Face tensors (what publishing sends to the engines): each
parameter gathered over its tensor-parallel shards and, for experts, over the expert-parallel
ranks, renamed and reshaped by ckpt_tools.mapping, on the leader of each pipeline stage."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from ckpt_tools import mapping
from trainer.megatron import pipeline as megatron_pipeline

_FP32_BIAS = "e_score_correction_bias"
_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
_MTP_LAYER = re.compile(r"(mtp\.layers\.\d+\.transformer_layer\.)(.+)")
_EXPERT = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.(.+)")


@dataclass(frozen=True)
class HFExport:
    """One model's export: its shape, the HF dtype, and the parallel sizes that split it."""

    model: GPTModel
    shape: mapping.ModelShape
    hf_config: dict[str, Any]
    tp_size: int
    etp_size: int  # the expert weights' tensor parallelism
    ep_size: int
    pp_size: int

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every (HF name, tensor), on global rank 0; a collective: every rank iterates it."""
        every = mapping.rules(self.shape)
        rules = {rule.megatron: rule for rule in every if not rule.repeat}
        # HF's copies of a tensor (an MTP layer's embedding and head), sent after it
        repeats = {rule.megatron: [r for r in every if r.repeat and r.megatron == rule.megatron] for rule in every}
        dtype = getattr(torch, self.hf_config.get("torch_dtype") or self.hf_config.get("dtype") or "float32")
        if self.pp_size == 1:
            yield from self._stage_weights(rules, repeats, dtype)
        else:
            yield from megatron_pipeline.from_every_stage(self._stage_weights(rules, repeats, dtype))

    def _stage_weights(self, rules: dict[str, mapping.Rule], repeats: dict[str, list[mapping.Rule]],
                       dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
        """This pipeline stage's weights, on its leader (global rank 0 without PP)."""
        offset = get_transformer_layer_offset(self.model.config)
        # DeepSeek-V3's routing bias is a buffer, not a parameter, and the engines need it too.
        biases = [(n, b) for n, b in self.model.named_buffers() if n.endswith("router.expert_bias")]
        for name, param in [*self.model.named_parameters(), *biases]:
            if getattr(param, "shared", False):  # the last stage's copy of tied embeddings
                continue
            key, layer, experts = self._checkpoint_key(name, offset)
            for expert, full in self._gather(name, param, experts):
                if not megatron_pipeline.is_stage_leader():
                    continue
                for rule in (rules[key], *repeats.get(key, ())):
                    for hf_name, tensor in zip(rule.hf_names(layer, expert), mapping.to_hf(rule, full, self.shape)):
                        # transformers keeps the routing bias in fp32 whatever the model's dtype.
                        # On the GPU: NCCL publishing packs them there; disk writers move them to the host.
                        yield hf_name, tensor.to(torch.float32 if hf_name.endswith(_FP32_BIAS) else dtype)

    def _checkpoint_key(self, name: str, offset: int) -> tuple[str, int | None, tuple[int, int] | None]:
        """(checkpoint key, global layer, (local expert, experts per rank) or None) of a parameter name
        of this stage, whose first layer is the model's `offset`th."""
        match = _LAYER.fullmatch(name)
        mtp = _MTP_LAYER.fullmatch(name)
        if mtp:  # an MTP layer's decoder layer: keyed alone, its HF layer in the rule's names
            layer, (prefix, rest) = None, mtp.groups()
            module = name.removesuffix(rest).removesuffix(".")
        elif match:
            layer, rest = int(match.group(1)) + offset, match.group(2)
            # Layers of different kinds: each keyed apart, as ckpt_tools.mapping.rules says.
            prefix = f"decoder.layers.{layer}." if self.shape.layers_differ else "decoder.layers."
            module = f"decoder.layers.{match.group(1)}"
        else:
            return name, None, None
        expert = _EXPERT.fullmatch(rest)
        if expert:
            per_rank = self.shape.num_experts // self.ep_size
            return prefix + "mlp.experts.experts." + expert.group(2), layer, (int(expert.group(1)), per_rank)
        # The layer spec stores some norms under other names (a dense layer's under its fused linears')
        keys = self.model.get_submodule(module).submodules_config.sharded_state_dict_keys_map
        stored = next((new + rest.removeprefix(old) for old, new in keys.items() if rest.startswith(old)), rest)
        return prefix + stored, layer, None

    def _gather(self, name: str, param: torch.Tensor,
                experts: tuple[int, int] | None) -> Iterator[tuple[int | None, torch.Tensor]]:
        """The full tensor (TP shards joined), once per global expert for expert weights.
        Expert weights are split over the expert-TP group (--expert-tensor-parallel-size), the rest
        over the TP group."""
        data = param.detach()
        if experts is None:
            tp_size, tp_group = self.tp_size, ps.get_tensor_model_parallel_group()
        else:
            tp_size, tp_group = self.etp_size, ps.get_expert_tensor_parallel_group()
        if getattr(param, "tensor_model_parallel", False) and tp_size > 1:
            parts = [torch.empty_like(data) for _ in range(tp_size)]
            dist.all_gather(parts, data.contiguous(), group=tp_group)
            dim = param.partition_dim  # type: ignore[attr-defined]  # megatron's, on a TP-split weight
            if name.endswith("linear_fc1.weight") and self.model.config.gated_linear_unit:
                # Each rank holds [gate shard; up shard]: join the gates, then the ups.
                halves = [p.chunk(2, dim=0) for p in parts]
                data = torch.cat([torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])])
            else:
                data = torch.cat(parts, dim=dim)
        if experts is not None and self.ep_size > 1:
            parts = [torch.empty_like(data) for _ in range(self.ep_size)]
            dist.all_gather(parts, data.contiguous(), group=ps.get_expert_model_parallel_group())
            local, per_rank = experts
            for ep_rank, part in enumerate(parts):
                yield ep_rank * per_rank + local, part
            return
        yield (experts[0] if experts else None), data
