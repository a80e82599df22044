"""Between the rollout and the optimizer: advantages per estimator, and the per-micro-batch loss.

Samples carry [R]-shaped tensors of different lengths; the estimators and losses work on padded
[B, T] tensors, so `padded` lines them up (zeros beyond each response, mask 0 there).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence

from trainer import advantages as adv
from trainer.backend import PackLoss
from trainer.batch import Pack, TrainSample
from trainer.config import LossOptions
from trainer.host_to_device import to_device
from trainer.losses import LossConfig, sft_loss, total_loss, value_loss


def padded(rows: list[Tensor]) -> Tensor:
    return pad_sequence([r.float() for r in rows], batch_first=True)


def padded_field(samples: list[TrainSample], name: str) -> Tensor:
    """padded() of a per-sample tensor that an earlier stage must have set on every sample."""
    rows = [getattr(s, name) for s in samples]
    if any(r is None for r in rows):
        raise ValueError(f"{sum(r is None for r in rows)} of {len(rows)} samples have no {name}")
    return padded(rows)


def loss_config(loss: LossOptions) -> LossConfig:
    return LossConfig(eps_clip=loss.eps_clip, eps_clip_high=loss.eps_clip_high, eps_clip_c=loss.eps_clip_c,
                      entropy_coef=loss.entropy_coef, use_kl_loss=loss.use_kl_loss, kl_loss_coef=loss.kl_loss_coef,
                      kl_loss_type=cast(adv.KLKind, loss.kl_loss_type), use_unbiased_kl=loss.use_unbiased_kl,
                      use_tis=loss.use_tis, tis_clip=loss.tis_clip, tis_clip_low=loss.tis_clip_low,
                      per_token_loss=loss.calculate_per_token_loss,
                      importance="sequence" if loss.advantage_estimator == "gspo" else "token",
                      surrogate="cispo" if loss.advantage_estimator == "cispo" else "ppo",
                      sft=loss.loss_type == "sft_loss")


def compute_advantages(loss: LossOptions, samples: list[TrainSample]) -> None:
    """Fill sample.advantages (and .returns) in place. Deterministic, so every rank that runs it
    on the same batch gets the same result. With --use-rollout-logprobs the engines' log-probs
    replace the trainer's as old_log_probs first (for the KL penalty and the PPO ratio, as slime)."""
    if loss.use_rollout_logprobs:
        use_rollout_log_probs(samples)
    mask = padded([s.loss_mask for s in samples])
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
    groups = [s.group_index for s in samples]  # of any sizes: a rollout function may return unequal ones
    # Per-token penalties on the reward: KL to the reference (--kl-coef) and, for on-policy
    # distillation, the reverse KL to the teacher (log pi - log teacher), which pushes the student
    # towards the teacher's tokens.
    old = padded_field(samples, "old_log_probs")
    penalty = torch.zeros_like(mask)
    if loss.kl_coef:
        penalty += loss.kl_coef * adv.kl(old, padded_field(samples, "ref_log_probs"),
                                         cast(adv.KLKind, loss.kl_loss_type))
    if loss.use_opd:  # validated: exactly when --opd-teacher-load is given
        penalty += loss.opd_kl_coef * (old - padded_field(samples, "teacher_log_probs"))
    penalty *= mask
    estimator = loss.advantage_estimator
    if estimator in ("grpo", "gspo", "cispo"):  # CISPO differs from GRPO in its loss alone
        # --disable-rewards-normalization: the raw rewards, no group normalization.
        scores = adv.grpo_advantages(rewards, groups, normalize_std=not loss.disable_grpo_std_normalization) \
            if loss.rewards_normalization else rewards
        # The penalty enters as REINFORCE++ does: its discounted sum from each token on.
        token_adv = scores[:, None] * mask + adv.reinforce_plus_plus_returns(
            torch.zeros_like(rewards), penalty, 1.0, mask, loss.gamma)
    elif estimator == "reinforce_plus_plus":
        token_adv = adv.reinforce_plus_plus_advantages(rewards, penalty, 1.0, mask, loss.gamma)
    elif estimator == "reinforce_plus_plus_baseline" and loss.rewards_normalization:
        token_adv = adv.reinforce_plus_plus_baseline_advantages(rewards, groups, penalty, 1.0, mask, loss.gamma)
    elif estimator == "reinforce_plus_plus_baseline":  # no group baseline: REINFORCE++ on the raw rewards
        token_adv = adv.reinforce_plus_plus_advantages(rewards, penalty, 1.0, mask, loss.gamma)
    else:  # ppo: per-token rewards (the reward on the last token, minus the penalty), GAE on the critic
        token_rewards = (-penalty).scatter_add(-1, adv.last_token_index(mask)[:, None], rewards[:, None])
        token_adv, returns = adv.gae(token_rewards, padded_field(samples, "values"), mask, loss.gamma, loss.lambd)
        for s, row in zip(samples, returns):
            s.returns = row[: s.response_length].clone()
    if loss.normalize_advantages:
        token_adv = adv.whiten(token_adv, mask)
    for s, row in zip(samples, token_adv):
        s.advantages = row[: s.response_length].clone()


def use_rollout_log_probs(samples: list[TrainSample]) -> None:
    """old_log_probs := the engines' log-probs of each response token (--use-rollout-logprobs)."""
    for s in samples:
        if s.rollout_log_probs is None or s.rollout_log_probs.shape != (s.response_length,):
            raise ValueError("--use-rollout-logprobs needs the engines' log-prob of every response token; "
                             "this rollout's samples lack them")
        s.old_log_probs = s.rollout_log_probs


def scaled(samples: list[TrainSample], batch_ids: list[int], per_token: bool,
            pack_loss: Callable[[list[TrainSample], Tensor, list[Tensor], list[Tensor] | None],
                                tuple[Tensor, dict[str, Tensor]]]) -> PackLoss:
    """Wrap a micro-batch loss (a mean over its samples or tokens) so that the sum over every
    micro-batch of every data-parallel rank is the mean over the whole global batch `batch_ids`."""
    num_samples = len(batch_ids)
    num_tokens = float(sum(samples[i].loss_mask.sum() for i in batch_ids))

    def loss(pack: Pack, outputs: list[Tensor], entropies: list[Tensor] | None) -> tuple[Tensor, dict[str, Tensor]]:
        group = [samples[i] for i in pack.sample_ids]
        host_mask = padded([s.loss_mask for s in group])  # its sum read on the host: no wait for the GPU
        scale = float(host_mask.sum()) / max(num_tokens, 1.0) if per_token else len(group) / num_samples
        value, metrics = pack_loss(group, to_device(host_mask, outputs[0].device), outputs, entropies)
        return value * scale, {k: v * scale for k, v in metrics.items()}

    return loss


def _column(group: list[TrainSample], name: str, device: torch.device) -> Tensor | None:
    values = [getattr(s, name) for s in group]
    return None if any(v is None for v in values) else to_device(padded(values), device)


def make_pack_loss(cfg: LossConfig, samples: list[TrainSample], batch_ids: list[int]) -> PackLoss:
    """The policy loss of one micro-batch (see scaled)."""
    def policy(group: list[TrainSample], mask: Tensor, logps: list[Tensor],
               entropies: list[Tensor] | None) -> tuple[Tensor, dict[str, Tensor]]:
        device = mask.device
        if cfg.sft:  # no old log-probs or advantages (--disable-compute-advantages-and-returns skips them)
            value, metrics = sft_loss(pad_sequence(logps, batch_first=True), mask, cfg.per_token_loss)
            metrics["loss"] = value.detach()
            return value, metrics
        value, metrics = total_loss(
            cfg, pad_sequence(logps, batch_first=True), to_device(padded_field(group, "old_log_probs"), device),
            to_device(padded_field(group, "advantages"), device), mask,
            entropy=pad_sequence(entropies, batch_first=True) if entropies is not None else None,
            ref_logp=_column(group, "ref_log_probs", device), rollout_logp=_column(group, "rollout_log_probs", device))
        metrics["loss"] = value.detach()
        return value, metrics

    return scaled(samples, batch_ids, cfg.per_token_loss, policy)


def make_value_pack_loss(value_clip: float, per_token: bool, samples: list[TrainSample],
                         batch_ids: list[int]) -> PackLoss:
    """PPO's clipped critic loss of one micro-batch (see scaled)."""
    def critic(group: list[TrainSample], mask: Tensor, values: list[Tensor],
               _: list[Tensor] | None) -> tuple[Tensor, dict[str, Tensor]]:
        device = mask.device
        old, returns = (to_device(padded_field(group, name), device) for name in ("values", "returns"))
        loss, metrics = value_loss(pad_sequence(values, batch_first=True), old, returns, mask, value_clip, per_token)
        return loss, {**metrics, "value_loss": loss.detach()}

    return scaled(samples, batch_ids, per_token, critic)
