"""Advantage and KL estimators against values worked out by hand."""

import math

import pytest
import torch

from trainer.advantages import (
    gae,
    grpo_advantages,
    gspo_advantages,
    kl,
    reinforce_plus_plus_advantages,
    reinforce_plus_plus_baseline_advantages,
    reinforce_plus_plus_returns,
    whiten,
)


def close(actual, expected, atol=1e-5):
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype), atol=atol, rtol=0)


def test_grpo_uses_unbiased_group_std():
    # Group [1, 0, 0, 0]: mean 0.25, deviations [0.75, -0.25, -0.25, -0.25],
    # unbiased var = (0.5625 + 3 * 0.0625) / 3 = 0.25, std = 0.5 (population std would be 0.433).
    # Group [2, 2, 2, 2]: all deviations 0, std 0 -> 0 / eps = 0.
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 2.0, 2.0, 2.0])
    close(grpo_advantages(rewards, [0, 0, 0, 0, 1, 1, 1, 1]), [1.5, -0.5, -0.5, -0.5, 0.0, 0.0, 0.0, 0.0])


def test_grpo_without_std_normalization_only_centres():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 3.0, 1.0, 2.0, 2.0])
    close(grpo_advantages(rewards, [0, 0, 0, 0, 1, 1, 1, 1], normalize_std=False),
          [0.75, -0.25, -0.25, -0.25, 1.0, -1.0, 0.0, 0.0])


def test_grpo_groups_are_named_by_group_index():
    # Groups [1, 3] and [0, 0]; [1, 3]: mean 2, unbiased std sqrt(2).
    rewards = torch.tensor([1.0, 3.0, 0.0, 0.0])
    s = math.sqrt(2)
    close(grpo_advantages(rewards, [0, 0, 1, 1]), [-1 / s, 1 / s, 0.0, 0.0])
    # The same groups interleaved, under other names: each sample keeps its advantage.
    close(grpo_advantages(torch.tensor([1.0, 0.0, 3.0, 0.0]), [7, 2, 7, 2]), [-1 / s, 0.0, 1 / s, 0.0])


def test_groups_of_unequal_size():
    # Groups [0, 2, 4] (mean 2, unbiased std 2) and [1, 3] (mean 2, unbiased std sqrt(2)); a group
    # of one has no unbiased std. REINFORCE++-baseline centres: [0, 2, 4] -> [-2, 0, 2], [1, 3] -> [-1, 1].
    rewards = torch.tensor([0.0, 1.0, 2.0, 3.0, 4.0])
    index = [0, 1, 0, 1, 0]
    close(grpo_advantages(rewards, index), [-1.0, -1 / math.sqrt(2), 0.0, 1 / math.sqrt(2), 1.0])
    with pytest.raises(ValueError, match="group 9 has 1"):
        grpo_advantages(torch.tensor([0.0, 1.0, 5.0]), [0, 0, 9])
    mask = torch.ones(5, 1)
    centred = torch.tensor([-2.0, -1.0, 0.0, 1.0, 2.0])  # mean 0, unbiased var 10 / 4
    out = reinforce_plus_plus_baseline_advantages(rewards, index, torch.zeros(5, 1), 0.0, mask)
    close(out, (centred / math.sqrt(10 / 4))[:, None].tolist())


def test_grpo_rejects_bad_shapes():
    with pytest.raises(ValueError):
        grpo_advantages(torch.zeros(5), [0, 0, 0, 0])
    with pytest.raises(ValueError):
        grpo_advantages(torch.zeros(3), [0, 1, 2])


def test_gspo_advantages_are_grpo_advantages():
    assert gspo_advantages is grpo_advantages


def test_kl_estimators():
    logp = torch.tensor([0.0, -1.0])
    ref = torch.tensor([-1.0, 0.0])
    close(kl(logp, ref, "k1"), [1.0, -1.0])                      # logp - ref
    close(kl(logp, ref, "k2"), [0.5, 0.5])                       # 0.5 * (+-1)^2
    # ref - logp = [-1, 1]: exp(-1) + 1 - 1, exp(1) - 1 - 1
    close(kl(logp, ref, "k3"), [math.exp(-1), math.e - 2])
    with pytest.raises(ValueError):
        kl(logp, ref, "k4")


def test_whiten_is_batch_wide_unbiased_and_masked():
    # Masked entries 1, 2, 3: mean 2, unbiased var (1 + 0 + 1) / 2 = 1.
    x = torch.tensor([[1.0, 2.0], [3.0, 100.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    close(whiten(x, mask), [[-1.0, 0.0], [1.0, 0.0]])


def test_reinforce_plus_plus_returns():
    rewards = torch.tensor([1.0, 0.0])
    kl_t = torch.tensor([[0.1, 0.2, 0.3], [0.5, 0.5, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    # kl_coef 0.5, gamma 0.5.
    # Row 0 token rewards: [-0.05, -0.1, -0.15 + 1 = 0.85]
    #   G2 = 0.85, G1 = -0.1 + 0.5 * 0.85 = 0.325, G0 = -0.05 + 0.5 * 0.325 = 0.1125
    # Row 1: last response token is t=1 (reward 0 added there), padded kl ignored:
    #   token rewards [-0.25, -0.25, 0]; G1 = -0.25, G0 = -0.25 + 0.5 * -0.25 = -0.375
    out = reinforce_plus_plus_returns(rewards, kl_t, 0.5, mask, gamma=0.5)
    close(out, [[0.1125, 0.325, 0.85], [-0.375, -0.25, 0.0]])


def test_reinforce_plus_plus_advantages_whiten_over_batch():
    # No KL, gamma 1: every response token's return is its sample's reward.
    # Masked values [1, 1, 0]: mean 2/3, unbiased var ((1/3)^2 * 2 + (2/3)^2) / 2 = 1/3.
    rewards = torch.tensor([1.0, 0.0])
    mask = torch.tensor([[1, 1], [1, 0]])
    s = math.sqrt(1 / 3)
    out = reinforce_plus_plus_advantages(rewards, torch.zeros(2, 2), 0.0, mask)
    close(out, [[(1 / 3) / s, (1 / 3) / s], [(-2 / 3) / s, 0.0]])


def test_reinforce_plus_plus_baseline_subtracts_group_mean_first():
    # Groups [3, 1] -> [1, -1] and [10, 10] -> [0, 0]; one token each.
    # Values [1, -1, 0, 0]: mean 0, unbiased var 2 / 3. (Without the baseline, [3, 1, 10, 10]
    # whitens to something else.)
    rewards = torch.tensor([3.0, 1.0, 10.0, 10.0])
    mask = torch.ones(4, 1)
    s = math.sqrt(2 / 3)
    out = reinforce_plus_plus_baseline_advantages(rewards, [0, 0, 1, 1], torch.zeros(4, 1), 0.0, mask)
    close(out, [[1 / s], [-1 / s], [0.0], [0.0]])


def test_gae():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 1.0, 5.0]])
    values = torch.tensor([[0.5, 0.6, 0.7], [0.5, 0.6, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    # gamma 0.9, lam 0.8 -> gamma * lam = 0.72.
    # Row 0: d2 = 1 + 0 - 0.7 = 0.3                 A2 = 0.3
    #        d1 = 0 + 0.9 * 0.7 - 0.6 = 0.03        A1 = 0.03 + 0.72 * 0.3 = 0.246
    #        d0 = 0 + 0.9 * 0.6 - 0.5 = 0.04        A0 = 0.04 + 0.72 * 0.246 = 0.21712
    # Row 1 (t=2 padded, its reward 5 and value 9 ignored):
    #        d1 = 1 + 0.9 * 0 - 0.6 = 0.4           A1 = 0.4
    #        d0 = 0 + 0.9 * 0.6 - 0.5 = 0.04        A0 = 0.04 + 0.72 * 0.4 = 0.328
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    close(adv, [[0.21712, 0.246, 0.3], [0.328, 0.4, 0.0]])
    close(ret, [[0.21712 + 0.5, 0.246 + 0.6, 0.3 + 0.7], [0.328 + 0.5, 0.4 + 0.6, 0.0]])


def test_low_var_kl_is_k3_clamped_and_weighted_before_the_clamp():
    logp = torch.tensor([0.0, -1.0, -12.0])
    ref = torch.tensor([-1.0, 0.0, 0.0])  # the last: exp(12) - 13, far above the clamp
    k3 = kl(logp, ref, "k3")
    close(kl(logp, ref, "low_var_kl"), [k3[0].item(), k3[1].item(), 10.0])
    # slime weighs by the importance ratio first, then clamps: 10 would be 5 the other way round.
    ratio = torch.tensor([2.0, 0.5, 0.5])
    close(kl(logp, ref, "low_var_kl", ratio), [2 * k3[0].item(), 0.5 * k3[1].item(), 10.0])
    close(kl(logp, ref, "k3", ratio), (ratio * k3).tolist())
