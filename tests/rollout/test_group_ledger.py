"""The fully asynchronous rollout's ledger (rollout.group_ledger), by sample ids, without engines:
every group the data source hands out is in exactly one place through every move; its state puts
in-flight groups back in front of pending as they were sent; the staleness bound drops or retries;
the capacity bounds what is in flight and ready."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from rollout.buffer import DataBuffer
from rollout.data import JsonlDataSource
from rollout.group_ledger import DROP, RETRY, GroupLedger, staleness
from rollout.sample import Sample, Status

N = 2  # samples per group


def ledger(tmp_path: Path, capacity: int = 4) -> GroupLedger:
    tmp_path.mkdir(parents=True, exist_ok=True)
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"input": f"q{i}", "label": str(i)}) + "\n" for i in range(50)))
    return GroupLedger(DataBuffer(JsonlDataSource(data, label_key="label", seed=5, n_samples_per_prompt=N)), capacity)


def generate(group: list[Sample], version: int, tokens: int = 3) -> list[Sample]:
    for s in group:
        s.tokens, s.response_length, s.loss_mask = [1] * (5 + tokens), tokens, [1] * tokens
        s.status, s.weight_version, s.reward = Status.COMPLETED, version, 1.0
    return group


def ids(groups: list[list[Sample]] | list[list[dict]]) -> set[int]:
    return {s.index if isinstance(s, Sample) else s["index"] for g in groups for s in g}


def places(book: GroupLedger) -> dict[str, set[int]]:
    state = book.state_dict()
    return {"pending": ids(state["buffer"]["pending"]), "ready": ids(state["ready"])}


def test_every_sample_is_in_one_place_through_random_moves(tmp_path: Path) -> None:
    """A random interleaving of the worker's and the trainer's moves: at each step every sample id
    handed out is pending (in flight counts as pending in the state), ready, trained or dropped,
    exactly once; none is lost."""
    book, rng = ledger(tmp_path, capacity=6), random.Random(7)
    in_flight: list[list[Sample]] = []
    trained: list[int] = []
    dropped: list[int] = []
    for _ in range(400):
        move = rng.choice(["take", "take", "finish", "stop", "requeue", "drop", "train"])
        if move == "take" and book.room():
            in_flight.append(book.take())
        elif move in ("finish", "stop", "requeue", "drop") and in_flight:
            group = in_flight.pop(rng.randrange(len(in_flight)))
            if move == "finish":
                book.generated(generate(group, 0))
            elif move == "stop":
                group[0].tokens, group[0].response_length, group[0].status = [9, 9], 1, Status.ABORTED
                book.stopped(group)
            elif move == "requeue":
                book.requeued(group)
            else:
                dropped += [s.index for s in group]
                book.dropped(group[0].group_index)
        elif move == "train":
            taken = book.take_ready(2, 0, None, DROP)
            trained += [s.index for g in taken or [] for s in g]
        where = places(book)
        handed_out = book.buffer.source.next_sample_index
        every = sorted([*where["pending"], *where["ready"], *trained, *dropped])
        assert every == list(range(handed_out)), "each sample handed out is in exactly one place"
        assert book.state_dict()["dropped_samples"] == len(dropped), "the state counts the drops"
        assert len(in_flight) + len(where["ready"]) // N <= 6, "the capacity bounds in flight and ready"
    assert len(set(trained)) == len(trained) > 20


def test_the_state_puts_in_flight_groups_in_front_of_pending_as_they_were_sent(tmp_path: Path) -> None:
    book = ledger(tmp_path)
    first, second = book.take(), book.take()
    first[0].tokens, first[0].response_length, first[0].status = [7, 7, 7], 2, Status.ABORTED
    book.stopped(first)  # back with its tokens: continued from them
    again = book.take()
    assert again[0].index == first[0].index and again[0].response_length == 2
    again[0].tokens += [8]  # generating: the live sample moves on, the ledger's copy does not
    book.generated(generate(second, 3))
    state = book.state_dict()
    assert [g[0]["index"] for g in state["buffer"]["pending"]] == [first[0].index]
    assert state["buffer"]["pending"][0][0]["tokens"] == [7, 7, 7], "as it was sent"
    restored = ledger(tmp_path / "again")
    restored.load_state_dict(state)
    assert restored.buffer.get(1)[0][0].tokens == [7, 7, 7]
    assert [g[0].index for g in restored.ready] == [second[0].index]
    assert restored.buffer.get(1)[0][0].index == second[0].index + N, "the data source goes on after the last taken"


def test_a_requeued_group_starts_again_from_its_prompt(tmp_path: Path) -> None:
    book = ledger(tmp_path)
    group = generate(book.take(), 2)
    group[1].status = Status.ABORTED
    book.requeued(group)
    again = book.take()
    assert [s.index for s in again] == [s.index for s in group]
    assert all(s.tokens == [] and s.response_length == 0 and s.status is Status.PENDING for s in again)
    assert book.report()[0].requeued_groups == 1


@pytest.mark.parametrize("handler", [DROP, RETRY])
def test_groups_beyond_the_staleness_bound_are_dropped_or_retried(tmp_path: Path, handler: str) -> None:
    book = ledger(tmp_path, capacity=8)
    old, mixed, fresh = book.take(), book.take(), book.take()
    book.generated(generate(old, 1))
    mixed = generate(mixed, 3)
    mixed[0].oldest_weight_version = 1  # continued across an update: its oldest tokens are version 1's
    book.generated(mixed)
    book.generated(generate(fresh, 3))
    assert staleness(mixed, 3) == 2 and staleness(fresh, 3) == 0
    assert book.take_ready(2, trainer_version=3, max_staleness=1, handler=handler) is None, "one group left"
    counts = book.report()[0]
    assert (counts.dropped_stale_samples, counts.retried_stale_samples) == ((2 * N, 0) if handler == DROP else
                                                                           (0, 2 * N))
    pending = book.state_dict()["buffer"]["pending"]
    assert ids(pending) == (set() if handler == DROP else ids([old, mixed]))
    assert all(s["response_length"] == 0 for g in pending for s in g), "retried from their prompts"
    assert [g[0].index for g in book.take_ready(1, 3, 1, handler) or []] == [fresh[0].index]
