"""LostNodeWatch: one batched node query per round over every engine in a restart, and each
watching block told once that its node is lost (supervisor.nodes; SLURM's side is in
tests/integration/test_node_failure.py)."""

from __future__ import annotations

import threading
from collections import Counter
from contextlib import ExitStack

from slurm.devcluster.daemons import wait_for
from supervisor.nodes import LostNodeWatch


def test_one_query_for_all_watched_nodes_and_each_block_told_once() -> None:
    down: dict[str, str] = {}
    queries: list[list[str]] = []
    reported: list[str] = []
    called: Counter[str] = Counter()

    def check(nodes: list[str]) -> dict[str, str]:
        queries.append(nodes)
        return {node: why for node, why in down.items() if node in nodes}

    watch = LostNodeWatch(check, lambda node, why: reported.append(node), interval_s=0.01)
    with ExitStack() as blocks:
        events: dict[str, threading.Event] = {}
        for name, node in (("a", "n1"), ("b", "n2"), ("c", "n1")):
            events[name] = blocks.enter_context(watch.watching([node], lambda name=name: called.update([name])))
        wait_for(lambda: len(queries) >= 3, 10, "three rounds")
        assert all(q == ["n1", "n2"] for q in queries), queries  # one call a round, not one per block
        assert not any(e.is_set() for e in events.values()) and not called

        down["n1"] = "DOWN+NOT_RESPONDING"
        wait_for(lambda: events["a"].is_set() and events["c"].is_set(), 10, "the blocks on n1 told")
        seen = len(queries)
        wait_for(lambda: len(queries) >= seen + 3, 10, "more rounds")
        assert called == Counter({"a": 1, "c": 1}) and not events["b"].is_set()
        assert set(reported) == {"n1"}
    down["n2"] = "DOWN"
    wait_for(lambda: not watch.running, 10, "the watch thread to end with no block open")
    assert "b" not in called, "a block that has ended is never called back"
