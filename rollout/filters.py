"""Built-in dynamic-sampling filters (--dynamic-sampling-filter-path): keep a group or drop it."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from rollout.sample import Sample


@dataclass(frozen=True)
class DynamicFilterOutput:
    """What slime's dynamic filters return (a plain bool works too)."""

    keep: bool
    reason: str | None = None


def filter_keeps(verdict: Any) -> bool:
    """A filter's verdict: DynamicFilterOutput's `keep` (the object itself is always truthy), or the bool."""
    return bool(verdict.keep) if hasattr(verdict, "keep") else bool(verdict)


def nonzero_reward_std(args, group: list[Sample]) -> bool:
    """Keep groups whose rewards differ: a group with one reward for all gives GRPO no signal."""
    rewards = [s.get_reward_value(args) for s in group]
    return len(rewards) > 1 and statistics.pstdev(rewards) > 0
