"""PPO-family policy loss, critic loss and their composition (slime's loss flags).

Reduction (masked_mean): by default the mean over each sample's masked tokens, then the mean over
samples; with --calculate-per-token-loss (per_token=True) the sum over all masked tokens of the
batch divided by their count. Metrics are detached 0-dim tensors (no host sync).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from trainer.advantages import KLKind, kl

Importance = Literal["token", "sequence"]
Surrogate = Literal["ppo", "cispo"]


def masked_mean(x: Tensor, mask: Tensor, per_token: bool = False) -> Tensor:
    """Mean of x [B, T] over mask [B, T]; see the module docstring for the two reductions."""
    mask = mask.to(x.dtype)
    if per_token:
        return (x * mask).sum() / mask.sum().clamp(min=1)
    per_sample = (x * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    return per_sample.mean()


def tis_weights(old_logp: Tensor, rollout_logp: Tensor, tis_clip: float, tis_clip_low: float = 0.0) -> Tensor:
    """Truncated importance weights pi_old / pi_rollout clamped to [tis_clip_low, tis_clip]
    (--use-tis, --tis-clip-low, --tis-clip).

    They correct for the rollout engine sampling from a slightly different distribution than
    the trainer computes; detached because they are a fixed reweighting, not a learned term."""
    return torch.exp(old_logp - rollout_logp).clamp(min=tis_clip_low, max=tis_clip).detach()


def token_losses(logp: Tensor, old_logp: Tensor, advantages: Tensor, loss_mask: Tensor,
                 eps_clip: float, eps_clip_high: float | None = None, eps_clip_c: float | None = None,
                 importance: Importance = "token", surrogate: Surrogate = "ppo") -> tuple[Tensor, Tensor, Tensor]:
    """policy_loss's per-token losses [B, T], before any reduction (slime's pg_loss), with the
    tokens whose ratio was clipped and the log-ratio logp - old_logp (per sample with GSPO)."""
    if eps_clip_c is not None and eps_clip_c <= 1:
        raise ValueError(f"eps_clip_c must be > 1, got {eps_clip_c}")
    eps_clip_high = eps_clip if eps_clip_high is None else eps_clip_high
    log_ratio = logp - old_logp
    if importance == "sequence":
        mask = loss_mask.to(log_ratio.dtype)
        seq = (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        log_ratio = seq.unsqueeze(-1).expand_as(logp)
    elif importance != "token":
        raise ValueError(f"importance must be 'token' or 'sequence', got {importance!r}")
    ratio = torch.exp(log_ratio)
    if surrogate == "cispo":
        truncated = ratio.clamp(1 - eps_clip, 1 + eps_clip_high)
        return -truncated.detach() * advantages * logp, truncated != ratio, log_ratio
    unclipped = -ratio * advantages
    clipped = -ratio.clamp(1 - eps_clip, 1 + eps_clip_high) * advantages
    losses = torch.maximum(unclipped, clipped)  # pessimistic bound
    if eps_clip_c is not None:
        losses = torch.where(advantages < 0, torch.minimum(losses, -eps_clip_c * advantages), losses)
    return losses, clipped > unclipped, log_ratio


def policy_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, loss_mask: Tensor,
                eps_clip: float, eps_clip_high: float | None = None,
                eps_clip_c: float | None = None, importance: Importance = "token",
                per_token_loss: bool = False,
                tis_weight: Tensor | None = None, surrogate: Surrogate = "ppo") -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate with ratio clipped to [1 - eps_clip, 1 + eps_clip_high].

    surrogate="cispo" (MiniMax-M1's CISPO, slime's compute_cispo_loss): -sg(clip(ratio)) * A * logp,
    the clipped ratio a constant weight, so clipped tokens still pass gradient through logp; its
    clipfrac counts the tokens whose ratio was clipped.

    eps_clip_c (dual clip, > 1): for negative advantages the loss is at most -eps_clip_c * A,
    so one very large ratio cannot dominate the update.
    importance="sequence" (GSPO): every token of a sample uses the sample's ratio
    exp(mean over its masked tokens of (logp - old_logp)).
    tis_weight [B, T] multiplies the per-token loss. Returns (loss, {clipfrac, approx_kl})."""
    losses, clipped_tokens, log_ratio = token_losses(logp, old_logp, advantages, loss_mask, eps_clip, eps_clip_high,
                                                     eps_clip_c, importance, surrogate)
    if tis_weight is not None:
        losses = losses * tis_weight
    metrics = {
        "clipfrac": masked_mean(clipped_tokens.to(logp.dtype), loss_mask, per_token_loss),
        "approx_kl": masked_mean(-log_ratio, loss_mask, per_token_loss),  # old - new, as slime
    }
    return masked_mean(losses, loss_mask, per_token_loss), {k: v.detach() for k, v in metrics.items()}


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, loss_mask: Tensor,
               value_clip: float, per_token_loss: bool = False) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped critic loss 0.5 * max((V - R)^2, (V_clip - R)^2), V_clip within value_clip of the
    old value. Returns (loss, {value_clipfrac})."""
    values_clipped = old_values + (values - old_values).clamp(-value_clip, value_clip)
    surr_unclipped = (values - returns) ** 2
    surr_clipped = (values_clipped - returns) ** 2
    loss = 0.5 * masked_mean(torch.maximum(surr_unclipped, surr_clipped), loss_mask, per_token_loss)
    clipfrac = masked_mean((surr_clipped > surr_unclipped).to(values.dtype), loss_mask, per_token_loss)
    return loss, {"value_clipfrac": clipfrac.detach()}


def sft_loss(logp: Tensor, loss_mask: Tensor, per_token_loss: bool = False) -> tuple[Tensor, dict[str, Tensor]]:
    """slime's sft_loss: the masked mean negative log-likelihood of the responses."""
    nll = masked_mean(-logp, loss_mask, per_token_loss)
    return nll, {"sft_loss": nll.detach()}


@dataclass(frozen=True)
class LossConfig:
    """Coefficients of total_loss; names and defaults follow slime's flags."""

    eps_clip: float = 0.2
    eps_clip_high: float | None = None
    eps_clip_c: float | None = None
    entropy_coef: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.0
    kl_loss_type: KLKind = "k1"
    use_unbiased_kl: bool = False
    use_tis: bool = False
    tis_clip: float = 2.0
    tis_clip_low: float = 0.0
    per_token_loss: bool = False
    importance: Importance = "token"
    surrogate: Surrogate = "ppo"  # cispo: --advantage-estimator cispo
    sft: bool = False  # --loss-type sft_loss


def total_loss(cfg: LossConfig, logp: Tensor, old_logp: Tensor, advantages: Tensor,
               loss_mask: Tensor, entropy: Tensor | None = None, ref_logp: Tensor | None = None,
               rollout_logp: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """pg_loss - entropy_coef * entropy + kl_loss_coef * kl, with optional TIS on pg_loss; with
    use_unbiased_kl the per-token KL is weighted by the ratio pi / pi_old (with its gradient, as
    slime). cfg.sft: the masked mean negative log-likelihood alone (slime's sft_loss).

    Metrics: pg_loss, clipfrac, approx_kl, and entropy / kl_loss (unscaled) / tis_mean only when
    that term is computed; sft: sft_loss."""
    if cfg.sft:
        return sft_loss(logp, loss_mask, cfg.per_token_loss)
    metrics: dict[str, Tensor] = {}
    tis = None
    if cfg.use_tis:
        if rollout_logp is None:
            raise ValueError("use_tis needs rollout_logp")
        tis = tis_weights(old_logp, rollout_logp, cfg.tis_clip, cfg.tis_clip_low)
        metrics["tis_mean"] = masked_mean(tis, loss_mask, cfg.per_token_loss)
    pg, pg_metrics = policy_loss(logp, old_logp, advantages, loss_mask, cfg.eps_clip,
                                 cfg.eps_clip_high, cfg.eps_clip_c, cfg.importance,
                                 cfg.per_token_loss, tis, cfg.surrogate)
    metrics.update(pg_loss=pg.detach(), **pg_metrics)
    loss = pg
    if entropy is not None:
        ent = masked_mean(entropy, loss_mask, cfg.per_token_loss)
        loss = loss - cfg.entropy_coef * ent
        metrics["entropy"] = ent.detach()
    elif cfg.entropy_coef != 0:
        raise ValueError("entropy_coef != 0 needs entropy")
    if cfg.use_kl_loss:
        if ref_logp is None:
            raise ValueError("use_kl_loss needs ref_logp")
        ratio = torch.exp(logp - old_logp) if cfg.use_unbiased_kl else None
        kl_mean = masked_mean(kl(logp, ref_logp, cfg.kl_loss_type, ratio), loss_mask, cfg.per_token_loss)
        loss = loss + cfg.kl_loss_coef * kl_mean
        metrics["kl_loss"] = kl_mean.detach()
    return loss, metrics
