"""Bounds as field metadata: a number's unit and the values validation accepts live on the
dataclass field they bound (FaultToleranceSpec's), and validation iterates over them."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Bound:
    """A field's unit and the values it accepts: `low` or more (more than `low` when low_open),
    and at most `high` when given."""

    unit: str  # "s" (seconds), "count" or "fraction"
    low: float
    high: float | None = None
    low_open: bool = False

    def violation(self, value: float) -> str | None:
        """Why `value` is out of bounds, as `slurmrl submit` prints it after the field's name; None
        when it is within them."""
        if self.high is None and not self.low_open:
            return None if value >= self.low else f"must be {self.low} or more, got {value}"
        above = value > self.low if self.low_open else value >= self.low
        if above and (self.high is None or value <= self.high):
            return None
        interval = f"{'(' if self.low_open else '['}{self.low}, {'inf)' if self.high is None else f'{self.high}]'}"
        return f"must be in {interval}, got {value}"


def bounded(default: T, unit: str, low: float, high: float | None = None, low_open: bool = False) -> T:
    """A dataclass field of `default` whose metadata holds its Bound."""
    return field(default=default, metadata={"bound": Bound(unit, low, high, low_open)})


def violations(instance: Any, prefix: str) -> list[str]:
    """"PREFIX.FIELD: why" for every bounded field of the dataclass `instance` out of its bounds,
    in the order of the fields."""
    problems = []
    for f in dataclasses.fields(instance):
        bound = f.metadata.get("bound")
        why = bound.violation(getattr(instance, f.name)) if bound else None
        if why:
            problems.append(f"{prefix}.{f.name}: {why}")
    return problems
