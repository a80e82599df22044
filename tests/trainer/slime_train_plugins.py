"""Trainer plug-ins written to slime's contracts (tests/trainer/test_slime_train_plugins.py loads
them by name): slime's own sft loss as a custom loss, a TIS that rejects tokens, a reducer, an
advantage function, a data post-process, reward post-process and conversion, a buffer filter."""

from __future__ import annotations

import torch

from slime.backends.megatron_utils.loss import get_log_probs_and_entropy


def sft_as_custom_loss(args, batch, logits, sum_of_sample_mean):
    """slime's sft_loss_function, verbatim but for its docstring."""
    response_lengths = batch["response_lengths"]
    total_lengths = batch["total_lengths"]
    _, log_probs_and_entropy = get_log_probs_and_entropy(
        logits, args=args, unconcat_tokens=batch["unconcat_tokens"], total_lengths=total_lengths,
        response_lengths=response_lengths, with_entropy=False)
    log_probs = log_probs_and_entropy["log_probs"]
    log_probs = torch.cat(log_probs, dim=0)
    loss = -sum_of_sample_mean(log_probs)
    if log_probs.numel() == 0:
        loss += 0 * logits.sum()
    return loss, {"loss": loss.clone().detach()}


def reject_second_token(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, **kwargs):
    """A TIS in mis.py's shape: weights 2 everywhere, and every sample's second token rejected."""
    masks = [m.clone() for m in loss_masks]
    for m in masks:
        m[1:2] = 0
    return pg_loss * 2.0, masks, {"rejected": torch.cat([1 - m for m in masks])}


def token_sum_reducer(total_lengths, response_lengths, loss_masks, calculate_per_token_loss):
    """Sums the masked per-token loss, whatever the flag says."""
    def reduce(x):
        return sum((part * m).sum() for part, m in zip(x.split(response_lengths), loss_masks))
    return reduce


def reward_as_advantage(args, rollout_data):
    """Every token's advantage is its sample's reward plus its KL (zeros without --kl-coef)."""
    rollout_data["advantages"] = [torch.full_like(kl, r) + kl for r, kl in zip(rollout_data["rewards"],
                                                                               rollout_data["kl"])]
    rollout_data["returns"] = rollout_data["advantages"]


def mask_first_token(args, rollout_id, rollout_data):
    for mask in rollout_data["loss_masks"]:
        mask[0] = 0


def tenfold_rewards(args, samples):
    raw = [s.get_reward_value(args) for s in samples]
    return raw, [10 * r for r in raw]


def to_train_data(args, samples):
    return {"tokens": [s.tokens for s in samples], "response_lengths": [s.response_length for s in samples],
            "rewards": [-1.0 for _ in samples], "raw_reward": [s.get_reward_value(args) for s in samples],
            "loss_masks": [[1] * s.response_length for s in samples]}


def take_last(args, rollout_id, buffer, num_samples):
    """Takes the last given-back groups first (slime's default takes the first)."""
    taken = buffer[-num_samples:]
    del buffer[-num_samples:]
    return taken[::-1]
