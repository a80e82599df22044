"""slime.rollout.filter_hub.dynamic_sampling_filters: slime's built-in dynamic-sampling filters,
so `--dynamic-sampling-filter-path slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std`
(DAPO's dynamic sampling) works as in slime."""

from __future__ import annotations

import statistics
from typing import Any

from rollout.filters import DynamicFilterOutput
from rollout.sample import Sample

__all__ = ["check_reward_nonzero_std", "check_reward_nonzero_std_with_fallback"]


def check_reward_nonzero_std(args: Any, samples: list[Sample], **kwargs: Any) -> DynamicFilterOutput:
    """Keep a group whose rewards differ (a group all right or all wrong teaches GRPO nothing)."""
    rewards = [sample.get_reward_value(args) for sample in samples]
    keep = len(rewards) > 1 and statistics.stdev(rewards) > 1e-6  # torch's std: the sample std
    return DynamicFilterOutput(keep=keep, reason=None if keep else f"zero_std_{round(rewards[0], 1)}")


def check_reward_nonzero_std_with_fallback(args: Any, samples: list[Sample], **kwargs: Any) -> DynamicFilterOutput:
    """The same, but a dropped group may still fill a batch the kept ones leave short, rather than
    another round of sampling."""
    output = check_reward_nonzero_std(args, samples, **kwargs)
    output.keep_when_insufficient = True
    return output
