"""Calling a custom generate function as slime does: --custom-generate-function-path, or a sample's
own (an eval set's custom_generate_function_path, --eval-config), with evaluation= when its
signature names it. What it returns takes its argument's place: a Sample (the argument or a new
one), or a list of them from one call (a multi-turn agent's samples), each then of the argument's
group; None keeps the argument, filled in place."""

from __future__ import annotations

import inspect
from typing import Any

from rollout.plugin_contracts import CustomGenerate
from rollout.plugins import load_function
from rollout.sample import Sample

CUSTOM_GENERATE = "--custom-generate-function-path"
SET_GENERATE = "--eval-config custom_generate_function_path"


class BadReturn(TypeError):
    """A custom generate returned something other than a Sample, a non-empty list of them, or None."""


class CustomGenerates:
    def __init__(self, path: str | None) -> None:
        """path: --custom-generate-function-path (None: the built-in generate)."""
        self.path = path
        self.default: CustomGenerate | None = load_function(path, CUSTOM_GENERATE) if path else None
        self._of_sets: dict[str, CustomGenerate] = {}  # eval sets' own, loaded once

    def for_sample(self, sample: Sample) -> CustomGenerate | None:
        """The sample's own function, else the flag's (None: the built-in generate)."""
        path = sample.generate_function_path
        if not path:
            return self.default
        if path not in self._of_sets:
            self._of_sets[path] = load_function(path, SET_GENERATE)
        return self._of_sets[path]

    def named(self, sample: Sample) -> tuple[str, str]:
        """(flag, path) of the function that generates `sample`, for error records."""
        if sample.generate_function_path:
            return SET_GENERATE, sample.generate_function_path
        return CUSTOM_GENERATE, self.path or ""


async def call(generate: CustomGenerate, args: Any, sample: Sample, sampling_params: dict[str, Any],
               evaluation: bool) -> list[Sample]:
    """One call: the samples that take `sample`'s place (BadReturn for anything else)."""
    out = await generate(args, sample, sampling_params, **({"evaluation": evaluation} if _takes_evaluation(generate)
                                                           else {}))
    if out is None:
        returned = [sample]  # filled in place
    elif isinstance(out, Sample):
        returned = [out]
    elif isinstance(out, (list, tuple)) and out and all(isinstance(s, Sample) for s in out):
        returned = list(out)
    else:
        raise BadReturn(f"returned {type(out).__name__} {out!r:.100}: a custom generate returns a Sample or a "
                        "non-empty list of Samples (or None, having filled its argument in place)")
    for new in returned:
        new.group_index = sample.group_index  # slime's: the returned samples stand in the argument's group
        new.index = sample.index if new.index is None else new.index
        new.custom_rm_path = new.custom_rm_path or sample.custom_rm_path  # an eval set's, for its reward
        if new is not sample and not new.spans:
            new.spans = list(sample.spans)  # what happened to the argument, for rollout.trace
    return returned


def _takes_evaluation(function: CustomGenerate) -> bool:
    """slime passes evaluation= to a custom generate whose signature names it."""
    try:
        return "evaluation" in inspect.signature(function).parameters
    except (TypeError, ValueError):  # no signature to read (a builtin): slime's inspect would fail too
        return False
