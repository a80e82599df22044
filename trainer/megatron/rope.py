"""RoPE for packed (thd) rows as one gather per forward and one rotation per layer.

Without TransformerEngine, megatron-core 0.16.1 rotates a thd row sample by sample in Python
(`rope_utils._apply_rotary_pos_emb_thd`: `cu_seqlens.tolist()`, a host sync, then a split and a
concat, in every layer). That makes a packed step host-bound and breaks torch.compile's graphs.
Here the model's rotary table is gathered once per forward at each token's own position, giving
megatron's "freqs for every packed position" form ([T, 1, 1, d]), and each layer rotates the
whole row at once with megatron's own bshd rotation: the same arithmetic, no per-sample loop.
Context parallelism keeps megatron's path (each rank holds zigzag slices of every sample)."""

from __future__ import annotations

from typing import Any

import megatron.core.transformer.attention as megatron_attention
import torch
from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd
from megatron.core.models.gpt import GPTModel
from torch import Tensor

_megatron_apply = megatron_attention.apply_rotary_pos_emb


def _apply_rotary_pos_emb(t: Tensor, freqs: Tensor, config: Any, cu_seqlens: Tensor | None = None,
                          mscale: float = 1.0, cp_group: torch.distributed.ProcessGroup | None = None) -> Tensor:
    """megatron's apply_rotary_pos_emb; a thd row whose freqs are already per token ([T, 1, 1, d],
    the case megatron maps by packed offset) is rotated in one call."""
    per_token = cu_seqlens is not None and freqs.size(0) == t.size(0) and not config.apply_rope_fusion
    if not per_token or (cp_group is not None and cp_group.size() > 1):
        return _megatron_apply(t, freqs, config=config, cu_seqlens=cu_seqlens, mscale=mscale, cp_group=cp_group)
    return _apply_rotary_pos_emb_bshd(t.unsqueeze(1), freqs, rotary_interleaved=config.rotary_interleaved,
                                      multi_latent_attention=config.multi_latent_attention, mscale=mscale).squeeze(1)


class PackedRope:
    """Installed on a GPTModel: while `positions` is set (a [T] tensor of each token's position in
    its own sample), the model's rotary table comes out per token."""

    def __init__(self, model: GPTModel) -> None:
        self.positions: Tensor | None = None
        megatron_attention.apply_rotary_pos_emb = _apply_rotary_pos_emb
        model.rotary_pos_emb.register_forward_hook(self._per_token, with_kwargs=True)

    def _per_token(self, module: torch.nn.Module, args: tuple, kwargs: dict[str, Any], table: Tensor) -> Tensor | None:
        if self.positions is None or not kwargs.get("packed_seq", False):
            return None
        return table[self.positions]
