"""The rollout's source of prompt groups: groups left unfinished by an earlier round (partial
rollout) come first, then fresh ones from the data source. Its state is part of a checkpoint."""

from __future__ import annotations

from typing import Any

from rollout.data import JsonlDataSource
from rollout.sample import Sample


class DataBuffer:
    def __init__(self, source: JsonlDataSource) -> None:
        self.source = source
        self.pending: list[list[Sample]] = []

    def get(self, num_groups: int) -> list[list[Sample]]:
        taken, self.pending = self.pending[:num_groups], self.pending[num_groups:]
        return taken + self.source.get_samples(num_groups - len(taken))

    def add(self, groups: list[list[Sample]]) -> None:
        """Keep groups a round could not finish; the next round resumes them first."""
        self.pending.extend(groups)

    def put_back(self, groups: list[list[Sample]]) -> None:
        """Groups taken and not finished, to go out again before the rest (rollout.group_ledger)."""
        self.pending[:0] = groups

    def state_dict(self) -> dict[str, Any]:
        return {"source": self.source.state_dict(),
                "pending": [[s.to_dict() for s in group] for group in self.pending]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.source.load_state_dict(state["source"])
        self.pending = [[Sample.from_dict(s) for s in group] for group in state["pending"]]
