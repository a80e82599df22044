"""Advantage estimators and KL estimators (slime's --advantage-estimator, --kl-loss-type).

Conventions:
- group_index [B] names each sample's group (the prompt it answers): groups are found by it, in
  any order and of any size, never by slicing the batch into runs of --n-samples-per-prompt.
- Token tensors are [B, T]; loss_mask [B, T] is 1 on response tokens that count. Outputs are
  zero where loss_mask is 0.
- Standard deviations are unbiased (Bessel-corrected, torch.std's default), as in slime and verl.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor

from rollout.sample import group_positions

KLKind = Literal["k1", "k2", "k3", "low_var_kl"]


def _groups(rewards: Tensor, group_index: Sequence[int]) -> list[Tensor]:
    """The positions of each group's samples, one index tensor per group."""
    if rewards.dim() != 1 or rewards.numel() != len(group_index):
        raise ValueError(f"rewards must be 1-D with one group_index per sample, got shape {tuple(rewards.shape)} "
                         f"and {len(group_index)} group indices")
    return [torch.tensor(positions) for positions in group_positions(group_index)]


def group_baseline(rewards: Tensor, group_index: Sequence[int]) -> Tensor:
    """rewards [B] minus the mean reward of their group."""
    out = rewards.clone()
    for members in _groups(rewards, group_index):
        out[members] = rewards[members] - rewards[members].mean()
    return out


def grpo_advantages(rewards: Tensor, group_index: Sequence[int], normalize_std: bool = True,
                    eps: float = 1e-6) -> Tensor:
    """GRPO: (r - group mean) / (unbiased group std + eps), one scalar per sample [B].

    normalize_std=False is slime's --disable-grpo-std-normalization (Dr. GRPO)."""
    centered = group_baseline(rewards, group_index)
    if not normalize_std:
        return centered
    out = centered.clone()
    for members in _groups(rewards, group_index):
        if members.numel() < 2:
            raise ValueError(f"the unbiased group std needs 2 or more samples a group; group "
                             f"{group_index[int(members[0])]} has 1")
        out[members] = centered[members] / (rewards[members].std() + eps)  # unbiased
    return out


# GSPO differs from GRPO only in the loss (a sequence-level importance ratio, see
# trainer.losses.policy_loss(importance="sequence")); its advantages are GRPO's.
gspo_advantages = grpo_advantages


def kl(logp: Tensor, ref_logp: Tensor, kind: KLKind, importance_ratio: Tensor | None = None) -> Tensor:
    """Per-token KL(policy || ref) estimators from samples of the policy (Schulman's k1/k2/k3),
    as slime's compute_approx_kl: times importance_ratio when given (--use-unbiased-kl), and
    low_var_kl is k3 clamped to [-10, 10] for stability."""
    log_ratio = logp.float() - ref_logp.float()
    if kind == "k1":
        out = log_ratio
    elif kind == "k2":
        out = 0.5 * log_ratio ** 2
    elif kind in ("k3", "low_var_kl"):
        out = torch.exp(-log_ratio) + log_ratio - 1  # >= 0: unbiased and low variance
    else:
        raise ValueError(f"unknown KL kind {kind!r}, expected k1, k2, k3 or low_var_kl")
    if importance_ratio is not None:
        out = importance_ratio * out
    return out.clamp(-10, 10) if kind == "low_var_kl" else out


def whiten(x: Tensor, mask: Tensor, eps: float = 1e-8) -> Tensor:
    """Normalise x to zero mean, unit (unbiased) variance over the masked entries of the whole
    batch (--normalize-advantages); masked-out entries become 0."""
    mask = mask.to(x.dtype)
    n = mask.sum()
    mean = (x * mask).sum() / n.clamp(min=1)
    var = (((x - mean) * mask) ** 2).sum() / (n - 1).clamp(min=1)
    return (x - mean) * torch.rsqrt(var + eps) * mask


def last_token_index(loss_mask: Tensor) -> Tensor:
    """[B] index of each row's last response token that counts."""
    # Index of the last 1 in each row: argmax finds the first 1 of the flipped row.
    T = loss_mask.shape[-1]
    return T - 1 - loss_mask.flip(-1).to(torch.long).argmax(dim=-1)


def reinforce_plus_plus_returns(rewards: Tensor, kl_per_token: Tensor, kl_coef: float,
                                loss_mask: Tensor, gamma: float = 1.0) -> Tensor:
    """REINFORCE++ returns [B, T], not yet whitened.

    Per-token reward = -kl_coef * kl, plus the scalar reward [B] on the last response token;
    then the discounted return-to-go G_t = r_t + gamma * G_{t+1}."""
    mask = loss_mask.to(kl_per_token.dtype)
    token_rewards = -kl_coef * kl_per_token * mask
    last = last_token_index(loss_mask).unsqueeze(-1)
    token_rewards = token_rewards.scatter_add(-1, last, rewards.to(token_rewards.dtype).unsqueeze(-1))
    returns = torch.zeros_like(token_rewards)
    running = torch.zeros_like(token_rewards[:, 0])
    for t in reversed(range(token_rewards.shape[-1])):
        running = token_rewards[:, t] + gamma * running
        returns[:, t] = running
    return returns * mask


def reinforce_plus_plus_advantages(rewards: Tensor, kl_per_token: Tensor, kl_coef: float,
                                   loss_mask: Tensor, gamma: float = 1.0) -> Tensor:
    """REINFORCE++: returns whitened over the whole batch (no critic, no group baseline)."""
    returns = reinforce_plus_plus_returns(rewards, kl_per_token, kl_coef, loss_mask, gamma)
    return whiten(returns, loss_mask)


def reinforce_plus_plus_baseline_advantages(rewards: Tensor, group_index: Sequence[int], kl_per_token: Tensor,
                                            kl_coef: float, loss_mask: Tensor,
                                            gamma: float = 1.0) -> Tensor:
    """REINFORCE++-baseline: subtract the group mean reward, then REINFORCE++."""
    return reinforce_plus_plus_advantages(group_baseline(rewards, group_index), kl_per_token,
                                          kl_coef, loss_mask, gamma)


def gae(rewards: Tensor, values: Tensor, loss_mask: Tensor, gamma: float,
        lam: float) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation for PPO with a critic; returns (advantages, returns).

    delta_t = r_t + gamma * V_{t+1} - V_t, A_t = delta_t + gamma * lam * A_{t+1}; returns = A + V.
    Values and rewards outside the mask are zeroed, so the value after the last token is 0."""
    mask = loss_mask.to(values.dtype)
    rewards, values = rewards * mask, values * mask
    advantages = torch.zeros_like(values)
    running = torch.zeros_like(values[:, 0])
    next_value = torch.zeros_like(values[:, 0])
    for t in reversed(range(values.shape[-1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        running = delta + gamma * lam * running
        advantages[:, t] = running
        next_value = values[:, t]
    return advantages * mask, (advantages + values) * mask
