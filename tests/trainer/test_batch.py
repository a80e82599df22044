"""Micro-batching (slime's --micro-batch-size, --use-dynamic-batch-size, --balance-data): each rule's
micro-batches, and that every sample of a global batch is trained exactly once on one rank."""

from __future__ import annotations

import random

import pytest
import torch

from trainer.batch import Batching, TrainSample, karmarkar_karp, rank_packs, schedule


def _flat(ranks: list[list[list[int]]]) -> list[int]:
    return sorted(i for rank in ranks for mbs in rank for i in mbs)


def test_static_micro_batches_are_consecutive_runs_dealt_round_robin() -> None:
    ranks = schedule([5, 9, 2, 7, 4, 4, 8], dp_size=2, batching=Batching(micro_batch_size=2))
    assert ranks == [[[0, 1], [4, 5]], [[2, 3], [6]]]
    assert schedule([3, 3], 1, Batching()) == [[[0], [1]]]  # slime's default: one sample each


def test_dynamic_packs_first_fit_within_the_budget() -> None:
    # slime's help example: 100, 200 and 300 tokens with a budget of 300 make [100, 200], [300].
    assert schedule([100, 200, 300], 1, Batching(dynamic=True, max_tokens=300)) == [[[0, 1], [2]]]
    # First fit, not next fit: a later short sample goes back into the first pack with room.
    assert schedule([6, 8, 5, 3], 1, Batching(dynamic=True, max_tokens=10)) == [[[0, 3], [1], [2]]]
    # A sample longer than the budget is alone in its pack.
    assert schedule([4, 30, 5], 1, Batching(dynamic=True, max_tokens=10)) == [[[0, 2], [1]]]


def test_dynamic_splits_packs_so_every_rank_gets_as_many() -> None:
    lengths = [3, 4, 2, 5, 1, 3]  # 18 tokens: one pack of 20, split into 4 for 4 ranks
    ranks = schedule(lengths, 4, Batching(dynamic=True, max_tokens=20))
    assert [len(rank) for rank in ranks] == [1, 1, 1, 1]
    assert _flat(ranks) == list(range(6))
    # Fewer samples than ranks: the ranks left over get no micro-batch.
    assert schedule([3, 4], 3, Batching(dynamic=True, max_tokens=20)) == [[[1]], [[0]], []]


@pytest.mark.parametrize("seed", range(20))
def test_balance_data_evens_the_ranks_tokens_as_karmarkar_karp_promises(seed: int) -> None:
    rng = random.Random(seed)
    dp = rng.choice([2, 3, 4])
    lengths = [rng.randint(1, 200) for _ in range(rng.randint(dp, 40))]
    for batching in (Batching(dynamic=True, max_tokens=256, balance=True), Batching(micro_batch_size=2, balance=True)):
        ranks = schedule(lengths, dp, batching)
        assert _flat(ranks) == list(range(len(lengths)))  # each sample once
        pack_tokens = [sum(lengths[i] for i in mbs) for rank in ranks for mbs in rank]
        rank_tokens = [sum(lengths[i] for mbs in rank for i in mbs) for rank in ranks]
        # Largest differencing keeps the spread within the heaviest micro-batch.
        assert max(rank_tokens) - min(rank_tokens) <= max(pack_tokens)
        if len(pack_tokens) % dp == 0:  # then each rank runs the same number of micro-batches
            assert len({len(rank) for rank in ranks}) == 1


def test_balance_data_beats_round_robin_where_round_robin_is_lopsided() -> None:
    lengths = [100, 1, 100, 1, 100, 1, 100, 1]
    static = schedule(lengths, 2, Batching())
    balanced = schedule(lengths, 2, Batching(balance=True))
    tokens = [[sum(lengths[i] for mbs in rank for i in mbs) for rank in ranks] for ranks in (static, balanced)]
    assert tokens == [[400, 4], [202, 202]]


def test_karmarkar_karp_equal_size_and_sums() -> None:
    parts = karmarkar_karp([8, 7, 6, 5, 4, 4], 2, equal_size=True)
    assert sorted(len(p) for p in parts) == [3, 3]
    assert sorted(sum([8, 7, 6, 5, 4, 4][i] for i in p) for p in parts) == [17, 17]
    with pytest.raises(ValueError, match="multiple of 4"):
        karmarkar_karp([1, 2, 3], 4, equal_size=True)


def test_rank_packs_carry_the_global_ids() -> None:
    samples = [TrainSample(tokens=torch.arange(n), response_length=1, loss_mask=torch.ones(1), reward=0.0,
                           group_index=k) for k, n in enumerate((4, 6, 3, 5))]
    ids = [3, 1, 0]  # a global batch: a subset, in its own order
    packs = [rank_packs(samples, ids, 2, r, Batching(dynamic=True, max_tokens=9)) for r in range(2)]
    assert [[p.sample_ids for p in rank] for rank in packs] == [[[3, 0]], [[1]]]
    assert packs[0][0].cu_seqlens.tolist() == [0, 5, 9] and packs[0][0].position_ids.tolist() == [*range(5), *range(4)]


def test_bad_batching_is_refused() -> None:
    with pytest.raises(ValueError, match="max_tokens"):
        Batching(dynamic=True)
    with pytest.raises(ValueError, match="micro_batch_size"):
        Batching(micro_batch_size=0)
