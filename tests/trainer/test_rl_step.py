"""compute_advantages under slime's --disable-rewards-normalization and --use-rollout-logprobs."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from trainer.args import build_parser
from trainer.batch import TrainSample
from trainer.config import LossOptions
from trainer.rl_step import compute_advantages as _compute_advantages

N_SAMPLES_PER_PROMPT = 2


def _args(*flags: str) -> LossOptions:
    parsed = build_parser().parse_args(["--hf-checkpoint", "unused", "--num-rollout", "1", "--n-samples-per-prompt",
                                        str(N_SAMPLES_PER_PROMPT), *flags])
    return LossOptions(**{f.name: getattr(parsed, f.name, False) for f in dataclasses.fields(LossOptions)})


def compute_advantages(loss: LossOptions, samples: list[TrainSample]) -> None:
    _compute_advantages(loss, samples)


def _samples(rewards: list[float]) -> list[TrainSample]:
    """Two samples a prompt, as --n-samples-per-prompt 2 says."""
    return [TrainSample(tokens=torch.arange(4), response_length=2, loss_mask=torch.ones(2), reward=r, group_index=i // 2,
                        rollout_log_probs=torch.tensor([-0.5, -0.25]), old_log_probs=torch.tensor([-1.0, -2.0]))
            for i, r in enumerate(rewards)]


@pytest.mark.parametrize("estimator", ["grpo", "gspo"])
def test_without_rewards_normalization_grpo_advantages_are_the_rewards(estimator: str) -> None:
    samples = _samples([1.0, 0.0, 3.0, 3.0])
    compute_advantages(_args("--advantage-estimator", estimator, "--disable-rewards-normalization"), samples)
    assert [s.advantages.tolist() for s in samples] == [[1.0, 1.0], [0.0, 0.0], [3.0, 3.0], [3.0, 3.0]]
    compute_advantages(_args("--advantage-estimator", estimator), samples)  # normalized: +-1/std within a group
    assert samples[0].advantages[0] == pytest.approx(0.5 / (0.5 ** 0.5 + 1e-6))
    assert samples[2].advantages.tolist() == [0.0, 0.0]


def test_without_rewards_normalization_reinforce_baseline_keeps_the_group_mean() -> None:
    normalized, raw = _samples([1.0, 0.0, 3.0, 3.0]), _samples([1.0, 0.0, 3.0, 3.0])
    compute_advantages(_args("--advantage-estimator", "reinforce_plus_plus_baseline"), normalized)
    compute_advantages(_args("--advantage-estimator", "reinforce_plus_plus_baseline",
                             "--disable-rewards-normalization"), raw)
    # Both are whitened; only without the baseline do the equal 3.0 rewards stand above the 0.0 one.
    assert normalized[2].advantages[0] == pytest.approx(normalized[3].advantages[0])
    assert normalized[2].advantages[0] < normalized[0].advantages[0]
    assert raw[2].advantages[0] > raw[0].advantages[0] > raw[1].advantages[0]


def test_use_rollout_logprobs_makes_the_engines_log_probs_the_old_ones() -> None:
    samples = _samples([1.0, 0.0])
    for s in samples:
        s.ref_log_probs = torch.zeros(2)
    compute_advantages(_args("--use-rollout-logprobs", "--kl-coef", "1", "--kl-loss-type", "k1"), samples)
    assert all(torch.equal(s.old_log_probs, torch.tensor([-0.5, -0.25])) for s in samples)
    # The KL penalty is the engines' log-probs minus the reference's, summed from each token on:
    # -(-0.5 - 0.25) and -(-0.25), on top of GRPO's (1 - 0.5) / std.
    score = 0.5 / (0.5 ** 0.5 + 1e-6)
    assert samples[0].advantages.tolist() == pytest.approx([score + 0.75, score + 0.25])
    missing = _samples([1.0, 0.0])
    missing[1].rollout_log_probs = None
    with pytest.raises(ValueError, match="--use-rollout-logprobs needs the engines' log-prob"):
        compute_advantages(_args("--use-rollout-logprobs"), missing)
