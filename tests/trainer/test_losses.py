"""Losses against values worked out by hand. old_logp is 0 throughout, so logp = log(ratio)."""

import math

import pytest
import torch

from trainer.losses import (
    LossConfig,
    masked_mean,
    policy_loss,
    tis_weights,
    total_loss,
    value_loss,
)


def close(actual, expected, atol=1e-5):
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype), atol=atol, rtol=0)


def log_ratios(*rows):
    return torch.tensor([[math.log(r) for r in row] for row in rows])


def test_masked_mean_per_sample_and_per_token():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 50.0, 60.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    close(masked_mean(x, mask), (6 / 3 + 4 / 1) / 2)              # mean of sample means = 3
    close(masked_mean(x, mask, per_token=True), (1 + 2 + 3 + 4) / 4)  # 2.5


# Ratios and advantages shared by the clipping tests, eps_clip 0.2, eps_clip_high 0.3 -> [0.8, 1.3]:
#   r=1.5, A=+1: max(-1.5, -1.3) = -1.3  clipped
#   r=0.5, A=-1: max( 0.5,  0.8) =  0.8  clipped
#   r=1.1, A=-1: max( 1.1,  1.1) =  1.1
#   r=0.9, A=+2: max(-1.8, -1.8) = -1.8
RATIOS = (1.5, 0.5, 1.1, 0.9)
ADV = torch.tensor([[1.0, -1.0, -1.0, 2.0]])
MASK = torch.ones(1, 4)


def test_policy_loss_asymmetric_clip_and_metrics():
    loss, m = policy_loss(log_ratios(RATIOS), torch.zeros(1, 4), ADV, MASK, 0.2, eps_clip_high=0.3)
    close(loss, (-1.3 + 0.8 + 1.1 - 1.8) / 4)
    close(m["clipfrac"], 2 / 4)
    close(m["approx_kl"], -(math.log(1.5) + math.log(0.5) + math.log(1.1) + math.log(0.9)) / 4)


def test_policy_loss_symmetric_clip_by_default():
    # First token now clipped at 1.2: -1.2.
    loss, _ = policy_loss(log_ratios(RATIOS), torch.zeros(1, 4), ADV, MASK, 0.2)
    close(loss, (-1.2 + 0.8 + 1.1 - 1.8) / 4)


def test_policy_loss_dual_clip_caps_negative_advantages():
    # r=5, A=-1: PPO gives max(5, 1.2) = 5, dual clip caps it at -3 * -1 = 3.
    # r=2, A=+1: max(-2, -1.2) = -1.2, dual clip does not apply to A > 0.
    logp, adv, mask = log_ratios((5.0, 2.0)), torch.tensor([[-1.0, 1.0]]), torch.ones(1, 2)
    loss, _ = policy_loss(logp, torch.zeros(1, 2), adv, mask, 0.2, eps_clip_c=3.0)
    close(loss, (3.0 - 1.2) / 2)
    loss, _ = policy_loss(logp, torch.zeros(1, 2), adv, mask, 0.2)
    close(loss, (5.0 - 1.2) / 2)
    with pytest.raises(ValueError):
        policy_loss(logp, torch.zeros(1, 2), adv, mask, 0.2, eps_clip_c=1.0)


def test_policy_loss_sequence_importance_gspo():
    # Row 0: log ratios [log 2, log 0.5], mean 0 -> s = 1, loss -1 per token.
    # Row 1: only t=0 counts (padded logp 100 ignored): s = 4, clipped to 1.2 -> -1.2.
    # (Token-level ratios would give row 0 = mean(-1.2, -0.5) instead.)
    logp = torch.tensor([[math.log(2.0), math.log(0.5)], [math.log(4.0), 100.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    adv = torch.ones(2, 2)
    loss, m = policy_loss(logp, torch.zeros(2, 2), adv, mask, 0.2, importance="sequence")
    close(loss, (-1.0 + -1.2) / 2)
    close(m["clipfrac"], (0 / 2 + 1 / 1) / 2)
    loss, _ = policy_loss(logp, torch.zeros(2, 2), adv, mask, 0.2, importance="sequence",
                          per_token_loss=True)
    close(loss, (-1.0 - 1.0 - 1.2) / 3)


def test_clipped_tokens_get_zero_gradient():
    # r=1.5, A=+1 and r=0.5, A=-1 are clipped in the direction of A: zero gradient.
    # r=1.5, A=-1 (unclipped branch is the max) and r=1, A=+1 keep d(-r*A/4)/dlogp = -r*A/4.
    logp = log_ratios((1.5, 0.5, 1.5, 1.0)).requires_grad_()
    adv = torch.tensor([[1.0, -1.0, -1.0, 1.0]])
    loss, _ = policy_loss(logp, torch.zeros(1, 4), adv, torch.ones(1, 4), 0.2)
    loss.backward()
    close(logp.grad, [[0.0, 0.0, 1.5 / 4, -1.0 / 4]])


def test_tis_weights_truncate_and_detach():
    old = torch.tensor([math.log(3.0), 0.0, 0.0], requires_grad=True)
    rollout = torch.tensor([0.0, math.log(2.0), 0.0])
    w = tis_weights(old, rollout, tis_clip=2.0)
    close(w, [2.0, 0.5, 1.0])  # exp(old - rollout) = [3, 0.5, 1], 3 truncated to 2
    assert not w.requires_grad


def test_value_loss_clipped():
    # value_clip 0.2:
    #   V=1, old 0, R=0.5: V_clip 0.2; max((1-0.5)^2, (0.2-0.5)^2) = max(0.25, 0.09) = 0.25
    #   V=2, old 2, R=3:   V_clip 2;   max(1, 1) = 1
    #   V=0, old 1, R=0:   V_clip 0.8; max(0, 0.64) = 0.64  clipped
    values = torch.tensor([[1.0, 2.0, 0.0]])
    loss, m = value_loss(values, torch.tensor([[0.0, 2.0, 1.0]]), torch.tensor([[0.5, 3.0, 0.0]]),
                         torch.ones(1, 3), value_clip=0.2)
    close(loss, 0.5 * (0.25 + 1.0 + 0.64) / 3)
    close(m["value_clipfrac"], 1 / 3)


def test_total_loss_composes_terms():
    # Ratio 1 everywhere, A = [1, 3]; TIS: exp(0 - [0, log 4]) = [1, 0.25] (under clip 2)
    #   pg = mean(-1 * 1, -3 * 0.25) = -0.875
    # entropy mean(0.5, 1.5) = 1, coef 0.1 -> -0.1
    # k1 kl = logp - ref = [0 - -1, 0 - 0] = [1, 0], mean 0.5, coef 0.3 -> +0.15
    cfg = LossConfig(entropy_coef=0.1, use_kl_loss=True, kl_loss_coef=0.3, use_tis=True, tis_clip=2.0)
    zeros, mask = torch.zeros(1, 2), torch.ones(1, 2)
    loss, m = total_loss(cfg, zeros, zeros, torch.tensor([[1.0, 3.0]]), mask,
                         entropy=torch.tensor([[0.5, 1.5]]), ref_logp=torch.tensor([[-1.0, 0.0]]),
                         rollout_logp=torch.tensor([[0.0, math.log(4.0)]]))
    close(loss, -0.875 - 0.1 + 0.15)
    close(m["pg_loss"], -0.875)
    close(m["entropy"], 1.0)
    close(m["kl_loss"], 0.5)
    close(m["tis_mean"], (1 + 0.25) / 2)
    close(m["clipfrac"], 0.0)
    close(m["approx_kl"], 0.0)


def test_total_loss_defaults_are_plain_ppo_and_missing_inputs_fail():
    zeros, mask = torch.zeros(1, 2), torch.ones(1, 2)
    loss, m = total_loss(LossConfig(), zeros, zeros, torch.tensor([[1.0, 3.0]]), mask)
    close(loss, (-1.0 - 3.0) / 2)
    assert set(m) == {"pg_loss", "clipfrac", "approx_kl"}
    for cfg in (LossConfig(use_kl_loss=True), LossConfig(use_tis=True), LossConfig(entropy_coef=0.1)):
        with pytest.raises(ValueError):
            total_loss(cfg, zeros, zeros, zeros, mask)


def test_tis_clip_low_raises_small_weights():
    w = tis_weights(torch.tensor([0.0, 0.0]), torch.tensor([math.log(10.0), 0.0]), tis_clip=2.0, tis_clip_low=0.5)
    close(w, [0.5, 1.0])  # exp(-log 10) = 0.1, raised to 0.5


def test_unbiased_kl_weighs_the_kl_by_the_ratio_with_its_gradient():
    # logp - old = [log 2, 0]: ratio [2, 1]; k1 kl = logp - ref = [log 2 + 1, 1]
    logp = torch.tensor([[math.log(2.0), 0.0]], requires_grad=True)
    cfg = LossConfig(use_kl_loss=True, kl_loss_coef=1.0, use_unbiased_kl=True)
    _, m = total_loss(cfg, logp, torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2),
                      ref_logp=torch.tensor([[-1.0, -1.0]]))
    close(m["kl_loss"], (2 * (math.log(2.0) + 1) + 1) / 2)


def test_sft_loss_is_the_masked_mean_nll():
    logp = torch.tensor([[-1.0, -3.0], [-2.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    loss, m = total_loss(LossConfig(sft=True), logp, logp, torch.zeros(2, 2), mask)
    close(loss, (2.0 + 2.0) / 2)  # per sample: mean(1, 3) = 2 and 2
    assert set(m) == {"sft_loss"}
    loss, _ = total_loss(LossConfig(sft=True, per_token_loss=True), logp, logp, torch.zeros(2, 2), mask)
    close(loss, 6.0 / 3)


def test_cispo_weighs_log_probs_by_the_clipped_ratio_and_keeps_their_gradient():
    # slime's compute_cispo_loss: -sg(clip(r, 0.8, 1.3)) * A * logp, logp = log r (old_logp is 0):
    #   r=1.5 -> 1.3 (clipped), r=0.5 -> 0.8 (clipped), r=1.1 and r=0.9 as they are.
    logp = log_ratios(RATIOS).requires_grad_()
    loss, m = policy_loss(logp, torch.zeros(1, 4), ADV, MASK, 0.2, eps_clip_high=0.3, surrogate="cispo")
    weights = torch.tensor([[1.3, 0.8, 1.1, 0.9]])
    close(loss, float(-(weights * ADV * log_ratios(RATIOS)).mean()))
    close(m["clipfrac"], 2 / 4)
    loss.backward()
    # every token has gradient, the clipped ones too (PPO's clipped tokens would have none): -w * A / 4
    close(logp.grad, (-weights * ADV / 4).tolist())
