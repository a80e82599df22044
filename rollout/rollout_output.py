"""What a --rollout-function-path or --eval-function-path returns, read as slime reads it: slime's
RolloutFnTrainOutput / RolloutFnEvalOutput (samples or eval data, and metrics to log), or the bare
list of groups / dict of sets of slime's older plug-ins (call_rollout_fn wraps those).

A train rollout's samples come back as groups: a group is a list of samples (a nested list, a
custom generate's several samples for one prompt, is flattened into its group); a bare Sample in
the list is grouped with those of its group_index. Samples a plug-in made without an index or a
group_index (both optional, as in slime) get them here, so everything downstream has both.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rollout.sample import Sample


@dataclass
class RolloutFnTrainOutput:
    samples: list[list[Sample]]
    metrics: dict[str, Any] = field(default_factory=dict)


@dataclass
class RolloutFnEvalOutput:
    data: dict[str, dict[str, Any]]
    metrics: dict[str, Any] = field(default_factory=dict)


def call_rollout_fn(fn: Callable[..., Any], *args: Any, evaluation: bool,
                    **kwargs: Any) -> RolloutFnTrainOutput | RolloutFnEvalOutput:
    """slime's: call a rollout function and wrap a legacy return value."""
    output = fn(*args, **kwargs, evaluation=evaluation)
    if isinstance(output, (RolloutFnTrainOutput, RolloutFnEvalOutput)):
        return output
    return RolloutFnEvalOutput(data=output) if evaluation else RolloutFnTrainOutput(samples=output)


class BadRolloutOutput(TypeError):
    """A rollout function returned what is not groups of samples."""


def train_groups(output: Any) -> tuple[list[list[Sample]], dict[str, Any]]:
    """A train rollout function's return value -> (its groups, with every index and group_index
    set; the metrics it reported)."""
    metrics: dict[str, Any] = {}
    if isinstance(output, RolloutFnTrainOutput):
        output, metrics = output.samples, dict(output.metrics or {})
    if not isinstance(output, (list, tuple)):
        raise BadRolloutOutput(f"returned {type(output).__name__}: a rollout function returns a list of groups "
                               "(lists of Samples) or slime's RolloutFnTrainOutput")
    groups: list[list[Sample]] = []
    by_group: dict[int, list[Sample]] = {}
    for item in output:
        if isinstance(item, Sample):
            if item.group_index is None:
                groups.append([item])
            elif item.group_index in by_group:
                by_group[item.group_index].append(item)
            else:
                by_group[item.group_index] = [item]
                groups.append(by_group[item.group_index])
        elif isinstance(item, (list, tuple)):
            groups.append(_flat(item))
        else:
            raise BadRolloutOutput(f"returned a list holding {type(item).__name__}: each item is a group (a list "
                                   "of Samples) or a Sample")
    _number(groups)
    return groups, metrics


def _flat(group: list[Any] | tuple[Any, ...]) -> list[Sample]:
    out: list[Sample] = []
    for item in group:
        if isinstance(item, Sample):
            out.append(item)
        elif isinstance(item, (list, tuple)) and all(isinstance(s, Sample) for s in item):
            out.extend(item)  # a custom generate's several samples for one prompt
        else:
            raise BadRolloutOutput(f"returned a group holding {type(item).__name__}: a group holds Samples")
    if not out:
        raise BadRolloutOutput("returned an empty group: a group holds one Sample or more")
    return out


def _number(groups: list[list[Sample]]) -> None:
    """Give every sample of `groups` a group_index (its group's, shared) and an index (unique where
    the plug-in left it out)."""
    used = {s.group_index for g in groups for s in g if s.group_index is not None}
    next_group = max(used, default=-1) + 1
    next_index = max((s.index for g in groups for s in g if s.index is not None), default=-1) + 1
    for group in groups:
        given = next((s.group_index for s in group if s.group_index is not None), None)
        if given is None:
            given, next_group = next_group, next_group + 1
        for sample in group:
            sample.group_index = given
            if sample.index is None:
                sample.index, next_index = next_index, next_index + 1
