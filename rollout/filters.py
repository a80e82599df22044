"""Dynamic-sampling filters' verdicts (--dynamic-sampling-filter-path): keep a group or drop it. The
built-in filters are slime's, in slime/rollout/filter_hub/dynamic_sampling_filters.py."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rollout import trace
from rollout.sample import Sample


@dataclass
class DynamicFilterOutput:
    """What slime's dynamic filters return (a plain bool works too)."""

    keep: bool
    reason: str | None = None
    # Kept after all when dropping it would leave too few groups, running or kept, to fill the
    # rollout (rather than starting another round of sampling).
    keep_when_insufficient: bool = False


def filter_keeps(verdict: Any, candidates: int | None = None, target: int | None = None) -> bool:
    """A filter's verdict: DynamicFilterOutput's `keep` (the object itself is always truthy), or the
    bool. `candidates`: the groups kept or still running, this one included; with `target`, a
    dropped group marked keep_when_insufficient is kept when candidates <= target (slime's rule)."""
    if not hasattr(verdict, "keep"):
        return bool(verdict)
    if verdict.keep:
        return True
    return bool(getattr(verdict, "keep_when_insufficient", False) and candidates is not None
                and target is not None and candidates <= target)


def judge_group(keep: Callable[[Any, list[Sample]], Any], args: Any, group: list[Sample], candidates: int,
                target: int) -> bool:
    """A filter's verdict on a group by filter_keeps, recorded as a filter span on each of its samples."""
    with trace.span(group, "filter") as span:
        verdict = keep(args, group)
        kept = filter_keeps(verdict, candidates, target)
        span.update(kept=kept, reason=getattr(verdict, "reason", None))
    return kept
