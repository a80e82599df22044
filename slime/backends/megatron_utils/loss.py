"""slime.backends.megatron_utils.loss's get_log_probs_and_entropy, as a --custom-loss-function-path
calls it on the `logits` it was given: slurmrl's trainer.slime_loss.ResponseLogits, whose log-probs
and entropies the backend computed from the logits (with their gradient)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from trainer.slime_loss import ResponseLogits

__all__ = ["get_log_probs_and_entropy"]


def get_log_probs_and_entropy(logits: Any, *, args: Any = None, unconcat_tokens: Any = None,
                              total_lengths: Any = None, response_lengths: Any = None, with_entropy: bool = False,
                              **kwargs: Any) -> tuple[Tensor, dict[str, list[Tensor]]]:
    """(empty, {"log_probs": [per sample], "entropy": [per sample]}), as slime's returns them."""
    if not isinstance(logits, ResponseLogits):
        raise TypeError(f"get_log_probs_and_entropy reads the `logits` slurmrl hands a custom loss "
                        f"(trainer.slime_loss.ResponseLogits), got {type(logits).__name__}")
    out: dict[str, list[Tensor]] = {"log_probs": logits.log_probs}
    if with_entropy:
        if logits.entropy is None:
            raise ValueError("with_entropy=True: slurmrl computes entropies when the loss has an entropy term; give "
                             "--entropy-coef")
        out["entropy"] = logits.entropy
    device = logits.log_probs[0].device if logits.log_probs else None
    return torch.empty((0,), device=device), out
