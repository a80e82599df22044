"""The rollout's source of prompt groups: groups left unfinished by an earlier round (partial
rollout) come first, then fresh ones from the data source. Its state is part of a checkpoint.
Plug-ins get it as slime's data source (get_samples, add_samples)."""

from __future__ import annotations

from typing import Any

from rollout.data import JsonlDataSource
from rollout.plugin_contracts import BufferFilter
from rollout.plugins import PluginError, raised
from rollout.sample import Sample


class DataBuffer:
    def __init__(self, source: JsonlDataSource, buffer_filter: BufferFilter | None = None,
                 plugin_args: Any = None, filter_path: str = "") -> None:
        """buffer_filter: --buffer-filter-path (filter_path), which picks the given-back groups the
        next rollout takes (slime's default: the first ones); it gets plugin_args as `args`."""
        self.source = source
        self.pending: list[list[Sample]] = []
        self.buffer_filter, self.plugin_args, self.filter_path = buffer_filter, plugin_args, filter_path

    def get(self, num_groups: int) -> list[list[Sample]]:
        taken = self._from_pending(num_groups) if self.pending and num_groups > 0 else []
        return taken + self.source.get_samples(num_groups - len(taken))

    def _from_pending(self, num_groups: int) -> list[list[Sample]]:
        if self.buffer_filter is None:
            taken, self.pending = self.pending[:num_groups], self.pending[num_groups:]
            return taken
        before = len(self.pending)
        try:  # slime's call: it takes the groups out of the buffer it is given (rollout_id None, as slime's)
            taken = self.buffer_filter(self.plugin_args, None, self.pending, num_groups)
        except Exception as err:
            raise raised("--buffer-filter-path", self.filter_path, err, "taking given-back groups") from err
        if (not isinstance(taken, list) or len(taken) > num_groups
                or len(taken) + len(self.pending) != before
                or not all(isinstance(g, list) and all(isinstance(x, Sample) for x in g) for g in taken)):
            raise PluginError(f"--buffer-filter-path {self.filter_path} must remove from the buffer and return at "
                              f"most {num_groups} groups (lists of Samples); it returned {taken!r:.200} and left "
                              f"{len(self.pending)} of {before}", "--buffer-filter-path", self.filter_path)
        return taken

    def add(self, groups: list[list[Sample]]) -> None:
        """Keep groups a round could not finish; the next round resumes them first."""
        self.pending.extend(groups)

    def put_back(self, groups: list[list[Sample]]) -> None:
        """Groups taken and not finished, to go out again before the rest (rollout.group_ledger)."""
        self.pending[:0] = groups

    # slime's data source names (RolloutDataSourceWithBuffer), as a rollout function calls them
    def get_samples(self, num_samples: int) -> list[list[Sample]]:
        """`num_samples` groups: those given back first, then fresh prompts."""
        return self.get(num_samples)

    def add_samples(self, samples: list[list[Sample]]) -> None:
        """Give groups back (slime's partial rollout): the next get_samples returns them first."""
        if not isinstance(samples, list) or not all(isinstance(g, list) for g in samples):
            raise TypeError("add_samples takes a list of groups, each a list of Samples")
        self.add(samples)

    def get_buffer_length(self) -> int:
        return len(self.pending)

    def state_dict(self) -> dict[str, Any]:
        return {"source": self.source.state_dict(),
                "pending": [[s.to_dict() for s in group] for group in self.pending]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.source.load_state_dict(state["source"])
        self.pending = [[Sample.from_dict(s) for s in group] for group in state["pending"]]
