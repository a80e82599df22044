"""Between the rollout and the optimizer: advantages per estimator, and the per-micro-batch loss.

Samples carry [R]-shaped tensors of different lengths; the estimators and losses work on padded
[B, T] tensors, so `padded` lines them up (zeros beyond each response, mask 0 there).
"""

from __future__ import annotations

import argparse

import torch
from torch import Tensor

from trainer import advantages as adv
from trainer.backend import PackLoss
from trainer.batch import Pack, TrainSample
from trainer.losses import LossConfig, total_loss


def padded(rows: list[Tensor]) -> Tensor:
    return torch.nn.utils.rnn.pad_sequence([r.float() for r in rows], batch_first=True)


def loss_config(args: argparse.Namespace) -> LossConfig:
    return LossConfig(eps_clip=args.eps_clip, eps_clip_high=args.eps_clip_high, eps_clip_c=args.eps_clip_c,
                      entropy_coef=args.entropy_coef, use_kl_loss=args.use_kl_loss, kl_loss_coef=args.kl_loss_coef,
                      kl_loss_type=args.kl_loss_type, use_tis=args.use_tis, tis_clip=args.tis_clip,
                      per_token_loss=args.calculate_per_token_loss,
                      importance="sequence" if args.advantage_estimator == "gspo" else "token")


def compute_advantages(args: argparse.Namespace, samples: list[TrainSample]) -> None:
    """Fill sample.advantages (and .returns) in place. Deterministic, so every rank that runs it
    on the same batch gets the same result."""
    mask = padded([s.loss_mask for s in samples])
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
    n = args.n_samples_per_prompt
    # Per-token penalties on the reward: KL to the reference (--kl-coef) and, for on-policy
    # distillation, the reverse KL to the teacher (log pi - log teacher), which pushes the student
    # towards the teacher's tokens.
    old = padded([s.old_log_probs for s in samples])
    penalty = torch.zeros_like(mask)
    if args.kl_coef:
        penalty += args.kl_coef * adv.kl(old, padded([s.ref_log_probs for s in samples]), args.kl_loss_type)
    if args.opd_teacher_url or args.opd_teacher_load:
        penalty += args.opd_kl_coef * (old - padded([s.teacher_log_probs for s in samples]))
    penalty *= mask
    estimator = args.advantage_estimator
    if estimator in ("grpo", "gspo"):
        scores = adv.grpo_advantages(rewards, n, normalize_std=not args.disable_grpo_std_normalization)
        # The penalty enters as REINFORCE++ does: its discounted sum from each token on.
        token_adv = scores[:, None] * mask + adv.reinforce_plus_plus_returns(
            torch.zeros_like(rewards), penalty, 1.0, mask, args.gamma)
    elif estimator == "reinforce_plus_plus":
        token_adv = adv.reinforce_plus_plus_advantages(rewards, penalty, 1.0, mask, args.gamma)
    elif estimator == "reinforce_plus_plus_baseline":
        token_adv = adv.reinforce_plus_plus_baseline_advantages(rewards, n, penalty, 1.0, mask, args.gamma)
    else:
        raise ValueError(f"--advantage-estimator {estimator} is computed with a critic (see trainer.loop)")
    if args.normalize_advantages:
        token_adv = adv.whiten(token_adv, mask)
    for s, row in zip(samples, token_adv):
        s.advantages = row[: s.response_length].clone()


def make_pack_loss(cfg: LossConfig, samples: list[TrainSample], batch_ids: list[int]) -> PackLoss:
    """The loss of one micro-batch, scaled so that the sum over every micro-batch of every
    data-parallel rank is the loss of the whole global batch `batch_ids`."""
    num_samples = len(batch_ids)
    num_tokens = float(sum(samples[i].loss_mask.sum() for i in batch_ids))

    def loss(pack: Pack, logps: list[Tensor], entropies: list[Tensor] | None) -> tuple[Tensor, dict[str, Tensor]]:
        group = [samples[i] for i in pack.sample_ids]
        device = logps[0].device
        mask = padded([s.loss_mask for s in group]).to(device)

        def column(name: str) -> Tensor | None:
            values = [getattr(s, name) for s in group]
            return None if any(v is None for v in values) else padded(values).to(device)

        value, metrics = total_loss(
            cfg, torch.nn.utils.rnn.pad_sequence(logps, batch_first=True), column("old_log_probs"),
            column("advantages"), mask,
            entropy=torch.nn.utils.rnn.pad_sequence(entropies, batch_first=True) if entropies is not None else None,
            ref_logp=column("ref_log_probs"), rollout_logp=column("rollout_log_probs"))
        scale = float(mask.sum()) / max(num_tokens, 1.0) if cfg.per_token_loss else len(group) / num_samples
        metrics["loss"] = value.detach()
        return value * scale, {k: v * scale for k, v in metrics.items()}

    return loss
