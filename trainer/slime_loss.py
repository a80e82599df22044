"""The micro-batch loss in slime's shape, for slime's loss plug-ins: --custom-loss-function-path
(--loss-type custom_loss), --custom-tis-function-path (and --get-mismatch-metrics) and
--custom-pg-loss-reducer-function-path. Without them trainer.rl_step's own loss runs.

slime's conventions, kept here: a micro-batch is a RolloutBatch (trainer.rollout_batch); per-token
values are the samples' response tokens concatenated; a loss is in the scale of
`sum_of_sample_mean`: the sum over samples of each sample's masked token mean (with
--calculate-per-token-loss, the sum over every masked token). slime's megatron then divides by the
global batch's samples (tokens); so does this module, through rl_step's scaling, so a slime-shaped
loss and slurmrl's own give the same gradient.

What slime's losses derive from the logits, slurmrl's backends have already computed (log-probs and
entropies of the response tokens, over the vocabulary's TP shards and CP chunks): a custom loss
gets them as ResponseLogits, and slime.backends.megatron_utils.loss.get_log_probs_and_entropy
reads them off it. The raw [1, T, V] logits are not handed out.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence

from rollout.plugin_contracts import CustomLoss, PgLossReducer, TisFunction
from trainer import advantages as adv
from trainer.backend import PackLoss
from trainer.batch import TrainSample
from trainer.losses import LossConfig, token_losses
from trainer.rl_step import scaled
from trainer.rollout_batch import concat, rollout_batch

Reducer = Callable[[Tensor], Tensor]


@dataclass
class ResponseLogits:
    """A custom loss's `logits`: each sample's response-token log-probs (with their gradient) and
    entropies (None unless the loss has an entropy term), computed by the backend from the logits."""

    log_probs: list[Tensor]
    entropy: list[Tensor] | None

    def sum(self) -> Tensor:
        """slime's losses add `0 * logits.sum()` to keep the graph whole: this does the same."""
        return concat(self.log_probs).sum()


def sum_of_sample_mean(response_lengths: list[int], loss_masks: list[Tensor], per_token: bool,
                       denominators: list[Tensor] | None = None) -> Reducer:
    """slime's get_sum_of_sample_mean: a concatenated per-token tensor -> the sum over samples of
    its masked mean (denominators: each sample's, default its own mask's sum), or with per_token the
    sum of its masked values."""
    denoms = denominators if denominators is not None else [m.sum() for m in loss_masks]

    def reduce(x: Tensor) -> Tensor:
        parts = x.split(response_lengths)
        if per_token:
            sums = [(p * m).sum() for p, m in zip(parts, loss_masks)]
        else:
            sums = [(p * m).sum() / d.clamp(min=1) for p, m, d in zip(parts, loss_masks, denoms)]
        return torch.stack(sums).sum() if sums else x.sum() * 0

    return reduce


def vanilla_tis(args: Any, *, pg_loss: Tensor, train_log_probs: list[Tensor], rollout_log_probs: list[Tensor],
                loss_masks: list[Tensor], **kwargs: Any) -> tuple[Tensor, list[Tensor], dict[str, Tensor]]:
    """slime's vanilla_tis_function: pg_loss weighted by exp(old - rollout) clamped to
    [--tis-clip-low, --tis-clip]."""
    ratio = torch.exp(concat(train_log_probs) - concat(rollout_log_probs))
    weights = ratio.clamp(min=args.tis_clip_low, max=args.tis_clip)
    metrics = {"tis": ratio.detach(), "tis_clipfrac": (weights != ratio).float(), "tis_abs": (ratio - 1).abs().detach()}
    return pg_loss * weights, loss_masks, metrics


@dataclass(frozen=True)
class SlimeLossPlugins:
    args: Any  # slime's Namespace, what the plug-ins get
    custom_loss: CustomLoss | None
    tis: TisFunction | None  # --custom-tis-function-path
    reducer: PgLossReducer | None  # --custom-pg-loss-reducer-function-path
    mismatch_metrics: bool  # --get-mismatch-metrics: the TIS function's metrics, with or without --use-tis


def slime_loss(cfg: LossConfig, plugins: SlimeLossPlugins) -> Callable[..., tuple[Tensor, dict[str, Tensor]]]:
    """rl_step's per-micro-batch loss (a mean over its samples, or tokens with per_token) computed
    in slime's shape with the plug-ins."""

    def loss(group: list[TrainSample], mask: Tensor, logps: list[Tensor],
             entropies: list[Tensor] | None) -> tuple[Tensor, dict[str, Tensor]]:
        batch = rollout_batch(group, mask.device)
        reduce = sum_of_sample_mean(batch["response_lengths"], batch["loss_masks"], cfg.per_token_loss)
        if plugins.custom_loss is not None:
            value, metrics = plugins.custom_loss(plugins.args, batch, ResponseLogits(logps, entropies), reduce)
        else:
            value, metrics = _policy(cfg, plugins, batch, logps, entropies, reduce)
        # slime's scale (a sum over the micro-batch) -> the micro-batch's mean, which rl_step scales
        count = float(mask.sum()) if cfg.per_token_loss else float(len(group))
        count = max(count, 1.0)
        return value / count, {k: torch.as_tensor(v, device=mask.device).detach() / count for k, v in metrics.items()}

    return loss


def _policy(cfg: LossConfig, plugins: SlimeLossPlugins, batch: dict[str, Any], logps: list[Tensor],
            entropies: list[Tensor] | None, reduce: Reducer) -> tuple[Tensor, dict[str, Tensor]]:
    """slime's policy_loss_function over slurmrl's per-token losses."""
    lengths, masks = batch["response_lengths"], batch["loss_masks"]

    def padded(values: list[Tensor]) -> Tensor:
        return pad_sequence([v.float() for v in values], batch_first=True)

    def flat(rows: Tensor) -> Tensor:
        return torch.cat([row[:n] for row, n in zip(rows, lengths)])

    losses, clipped, log_ratio = token_losses(
        padded(logps), padded(batch["log_probs"]), padded(batch["advantages"]), padded(masks), cfg.eps_clip,
        cfg.eps_clip_high, cfg.eps_clip_c, cfg.importance, cfg.surrogate)
    pg_loss, pg_masks = flat(losses), masks
    metrics: dict[str, Tensor] = {}
    if cfg.use_tis or plugins.mismatch_metrics:
        if "rollout_log_probs" not in batch:
            raise ValueError("--use-tis / --get-mismatch-metrics need the engines' log-prob of every response token")
        tis = plugins.tis or cast(TisFunction, vanilla_tis)
        metrics["ois"] = reduce(torch.exp(flat(log_ratio)).detach())
        weighted, pg_masks, tis_metrics = tis(
            args=plugins.args, pg_loss=pg_loss, train_log_probs=batch["log_probs"],
            rollout_log_probs=batch["rollout_log_probs"], loss_masks=masks, total_lengths=batch["total_lengths"],
            response_lengths=lengths)
        if cfg.use_tis:
            pg_loss = weighted
        metrics.update({k: reduce(torch.as_tensor(v, device=pg_loss.device).float()) for k, v in tis_metrics.items()})
    if plugins.reducer is not None:
        pg_reduce = plugins.reducer(batch["total_lengths"], lengths, pg_masks, cfg.per_token_loss)
    else:  # rejected tokens (a modified mask) leave the numerator; the denominators stay the samples'
        pg_reduce = sum_of_sample_mean(lengths, pg_masks, cfg.per_token_loss, [m.sum() for m in masks])
    pg = pg_reduce(pg_loss)
    metrics.update(pg_loss=pg.detach(), clipfrac=reduce(flat(clipped).float()), approx_kl=reduce(flat(-log_ratio)))
    value = pg
    if entropies is not None:
        entropy = reduce(concat(entropies))
        value = value - cfg.entropy_coef * entropy
        metrics["entropy"] = entropy.detach()
    if cfg.use_kl_loss:
        logp, old = concat(logps), concat(batch["log_probs"])
        ratio = torch.exp(logp - old) if cfg.use_unbiased_kl else None
        kl_loss = reduce(adv.kl(logp, concat(batch["ref_log_probs"]), cfg.kl_loss_type, ratio))
        value = value + cfg.kl_loss_coef * kl_loss
        metrics["kl_loss"] = kl_loss.detach()
    return value, metrics


def make_slime_pack_loss(cfg: LossConfig, plugins: SlimeLossPlugins, samples: list[TrainSample],
                         batch_ids: list[int]) -> PackLoss:
    """rl_step.make_pack_loss's counterpart for slime's loss plug-ins."""
    return scaled(samples, batch_ids, cfg.per_token_loss, slime_loss(cfg, plugins))
