"""A rollout function may return groups of unequal size: advantages and pass@k are computed per
group (by each sample's group_index), never by slicing the batch into runs of
--n-samples-per-prompt."""

from __future__ import annotations

import dataclasses
import statistics

import pytest
import torch

from rollout.eval import eval_metrics
from rollout.generate import RolloutArgs, generate_rollout
from rollout.sample import Sample, Status
from trainer.args import build_parser
from trainer.batch import TrainSample
from trainer.config import LossOptions
from trainer.rl_step import compute_advantages

# Two prompts: the first with 3 responses, the second with 5 (--n-samples-per-prompt says 4).
REWARDS = [[1.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0, 0.0]]


def unequal_groups(args, rollout_id, data_buffer, evaluation=False) -> list[list[Sample]]:
    """--rollout-function-path: one group of 3 samples and one of 5, each with its weight version."""
    index = iter(range(100))
    return [[Sample(index=next(index), group_index=g, prompt="p", tokens=[1, 2, 3, 4], response="r",
                    response_length=2, loss_mask=[1, 1], reward=r, status=Status.COMPLETED,
                    rollout_log_probs=[-0.5, -0.5], weight_version=7)
             for r in rewards] for g, rewards in enumerate(REWARDS)]


def _by_hand(rewards: list[float], eps: float = 1e-6) -> list[float]:
    mean, std = statistics.mean(rewards), statistics.stdev(rewards)  # unbiased, as GRPO's
    return [(r - mean) / (std + eps) for r in rewards]


def test_a_rollout_function_with_unequal_groups_gets_per_group_advantages() -> None:
    rollout = RolloutArgs(hf_checkpoint="unused", router_url="http://unused:1", n_samples_per_prompt=4,
                          rollout_function_path=f"{__name__}.unequal_groups")
    groups = generate_rollout(rollout, 0, data_buffer=None)
    samples = [TrainSample.from_sample(s) for group in groups for s in group]
    assert [s.group_index for s in samples] == [0, 0, 0, 1, 1, 1, 1, 1]
    assert {s.weight_version for s in samples} == {7}
    for s in samples:
        s.old_log_probs = torch.tensor([-0.5, -0.5])
    parsed = build_parser().parse_args(["--hf-checkpoint", "unused", "--num-rollout", "1",
                                        "--n-samples-per-prompt", "4", "--advantage-estimator", "grpo"])
    compute_advantages(LossOptions(**{f.name: getattr(parsed, f.name, False) for f in dataclasses.fields(LossOptions)}),
                       samples)
    want = [a for rewards in REWARDS for a in _by_hand(rewards)]
    assert [s.advantages[0].item() for s in samples] == pytest.approx(want, abs=1e-5)


def test_pass_at_k_over_unequal_groups_is_per_prompt() -> None:
    # Group 0: 3 samples, 1 passes; group 1: 5 samples, 2 pass. k runs up to the smallest group (3).
    samples = unequal_groups(None, 0, None)
    flat = [s for group in samples for s in group]
    got = eval_metrics({"toy": {"rewards": [s.reward for s in flat], "samples": flat}}, 4)
    pass1 = (1 / 3 + 2 / 5) / 2
    pass2 = ((1 - 1 / 3) + (1 - (3 * 2) / (5 * 4))) / 2  # 1 - C(n-c, 2) / C(n, 2) per prompt
    assert got["eval/toy-pass@1"] == pytest.approx(pass1)
    assert got["eval/toy-pass@2"] == pytest.approx(pass2)
    assert "eval/toy-pass@4" not in got  # the group of 3 has no estimate for k = 4
