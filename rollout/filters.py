"""Built-in dynamic-sampling filters (--dynamic-sampling-filter-path): keep a group or drop it."""

from __future__ import annotations

import statistics

from rollout.sample import Sample


def nonzero_reward_std(args, group: list[Sample]) -> bool:
    """Keep groups whose rewards differ: a group with one reward for all gives GRPO no signal."""
    rewards = [s.reward for s in group]
    return len(rewards) > 1 and statistics.pstdev(rewards) > 0
