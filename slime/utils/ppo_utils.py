"""slime.utils.ppo_utils' estimators a custom loss or advantage function calls (trainer.advantages,
trainer.losses)."""

from __future__ import annotations

import torch
from torch import Tensor

from trainer.advantages import kl
from trainer.losses import token_losses

__all__ = ["compute_approx_kl", "compute_policy_loss"]


def compute_approx_kl(log_probs: Tensor, log_probs_base: Tensor, kl_loss_type: str,
                      importance_ratio: Tensor | None = None) -> Tensor:
    """Per-token KL(policy || base) by k1, k2, k3 or low_var_kl."""
    return kl(log_probs, log_probs_base, kl_loss_type, importance_ratio)  # type: ignore[arg-type]


def compute_policy_loss(ppo_kl: Tensor, advantages: Tensor, eps_clip: float, eps_clip_high: float,
                        eps_clip_c: float | None = None) -> tuple[Tensor, Tensor]:
    """PPO's clipped per-token losses and which tokens were clipped, from ppo_kl = old - new."""
    losses, clipped, _ = token_losses(-ppo_kl, torch.zeros_like(ppo_kl), advantages, torch.ones_like(ppo_kl),
                                      eps_clip, eps_clip_high, eps_clip_c)
    return losses, clipped.float()
