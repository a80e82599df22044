"""DeepSeek-V3's aux-loss-free load balancing: after each optimizer step every router's expert
bias moves by --moe-router-bias-update-rate towards the experts that got fewer tokens, counted over
the step's training forwards on all TP x DP x CP ranks (megatron's finalize_model_grads does this)."""

from __future__ import annotations

import torch
from megatron.core.distributed.finalize_model_grads import _update_router_expert_bias
from megatron.core.models.gpt import GPTModel


def update_expert_bias(model: GPTModel) -> None:
    """Megatron's update, then the token counts restart: megatron-core 0.16.1 never clears them,
    though its update is meant per global batch (Megatron-LM's, not core's, training loop does)."""
    if not model.config.moe_router_enable_expert_bias:
        return
    _update_router_expert_bias([model], model.config)
    with torch.no_grad():
        for module in model.modules():
            counts = getattr(module, "local_tokens_per_expert", None)
            if counts is not None:
                counts.zero_()
