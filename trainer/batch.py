"""What one training step consumes: per-sample tensors, and micro-batches that pack several
samples into one sequence (so --seq-length never caps a sample's context).

A sample's tokens are prompt + response; its response has `response_length` tokens, and the
log-prob of response token j is read from the logits at the position before it. Every
per-response tensor (loss mask, advantages, log-probs) has response_length entries.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import torch
from torch import Tensor

from rollout.sample import Sample
from trainer.config import BatchingOptions


@dataclass
class TrainSample:
    tokens: Tensor  # int64 [L]: prompt, then response
    response_length: int
    loss_mask: Tensor  # float32 [R]
    reward: float  # what the advantages are computed from
    group_index: int  # the rollout sample's: the samples of one prompt share it (advantages per group)
    raw_reward: float | None = None  # what the reward metrics report, where a plug-in gave `reward` (train_data)
    rollout_log_probs: Tensor | None = None  # [R], from the engine
    weight_version: int | None = None  # the (oldest) weights that generated it (None: the initial checkpoint)
    staleness: int = 0  # the trainer's version minus weight_version when trained (set by the loop)
    sample_index: int | None = None  # the rollout sample's index (unique over the run: the data source counts)
    # Filled in by the trainer before the update, one [R] tensor each.
    advantages: Tensor | None = None
    returns: Tensor | None = None
    old_log_probs: Tensor | None = None
    ref_log_probs: Tensor | None = None
    teacher_log_probs: Tensor | None = None
    values: Tensor | None = None

    @property
    def prompt_length(self) -> int:
        return self.tokens.numel() - self.response_length

    @classmethod
    def from_sample(cls, sample: Sample, reward_key: str | None = None, check_reward: bool = True) -> TrainSample:
        """reward_key (--reward-key): which entry of a dict reward is trained on; check_reward False:
        the caller sets the reward (a plug-in gave it), the sample's is not read."""
        r = sample.response_length
        logp = torch.tensor(sample.rollout_log_probs, dtype=torch.float32) if sample.rollout_log_probs else None
        if sample.group_index is None:  # rollout.rollout_output numbers every sample a plug-in hands back
            raise ValueError(f"sample {sample.index} has no group_index")
        mask = (sample.loss_mask or [])[:r] or [1] * r  # none given (slime's None, or empty): every token trains
        return cls(tokens=torch.tensor(sample.tokens, dtype=torch.int64), response_length=r,
                   loss_mask=torch.tensor(mask, dtype=torch.float32),
                   reward=sample.reward_value(reward_key) if check_reward else 0.0, group_index=sample.group_index,
                   rollout_log_probs=logp, weight_version=sample.generating_version, sample_index=sample.index)


@dataclass
class Pack:
    """One micro-batch: samples `sample_ids` concatenated into one sequence of T tokens.
    cu_seqlens [n + 1] (int32) marks where each sample starts and ends."""

    sample_ids: list[int]
    tokens: Tensor  # int64 [T]
    cu_seqlens: Tensor  # int32 [n + 1]
    position_ids: Tensor = field(init=False)  # int64 [T], restarting at 0 for each sample

    def __post_init__(self) -> None:
        lengths = (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).tolist()
        self.position_ids = (torch.cat([torch.arange(n) for n in lengths]) if lengths
                             else torch.zeros(0, dtype=torch.int64))

    @property
    def num_tokens(self) -> int:
        return self.tokens.numel()


@dataclass(frozen=True)
class Batching:
    """How one global batch becomes micro-batches on each data-parallel rank (slime's flags and
    defaults): --micro-batch-size samples per micro-batch, or with --use-dynamic-batch-size
    first-fit packs of at most --max-tokens-per-gpu tokens; --balance-data hands the
    micro-batches to ranks by Karmarkar-Karp on their token counts instead of round-robin."""

    dynamic: bool = False
    micro_batch_size: int = 1
    max_tokens: int | None = None
    balance: bool = False

    def __post_init__(self) -> None:
        if self.dynamic and (self.max_tokens or 0) < 1:
            raise ValueError("dynamic batching needs max_tokens >= 1 (--max-tokens-per-gpu)")
        if self.micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be 1 or more, got {self.micro_batch_size}")

    @classmethod
    def of(cls, options: BatchingOptions, for_log_probs: bool = False, cp_size: int = 1) -> Batching:
        """The training micro-batches, or (for_log_probs) those of the no-grad log-prob passes,
        packed to --log-probs-max-tokens-per-gpu when dynamic (slime's default: the same budget).
        Under context parallelism a pack holds cp_size times the budget (as slime: each CP rank
        holds 1 / cp_size of a pack's tokens)."""
        budget = options.max_tokens_per_gpu
        if for_log_probs and options.log_probs_max_tokens_per_gpu:
            budget = options.log_probs_max_tokens_per_gpu
        return cls(dynamic=options.use_dynamic_batch_size, micro_batch_size=options.micro_batch_size,
                   max_tokens=budget * cp_size if options.use_dynamic_batch_size and budget else budget,
                   balance=options.balance_data)


def schedule(lengths: list[int], dp_size: int, batching: Batching) -> list[list[list[int]]]:
    """Per data-parallel rank, its micro-batches as positions into `lengths` (one global batch, in
    order), as slime's dp_schedule: pack first, distribute second.

    Static: consecutive runs of micro_batch_size samples. Dynamic: first-fit packs of at most
    max_tokens tokens (a longer sample alone in its own), then the largest packs split in two until
    every rank can get as many. Micro-batches go round-robin to ranks, or (balance) by
    Karmarkar-Karp on their token counts, each rank getting the same number when they divide
    evenly. With fewer micro-batches than ranks, some ranks get none."""
    n = len(lengths)
    if batching.dynamic:
        bins = first_fit_pack(lengths, batching.max_tokens or 0)
        target = max(-(-len(bins) // dp_size) * dp_size, dp_size)
        expand_bins_by_splitting(bins, target, lengths)
    else:
        step = batching.micro_batch_size
        bins = [list(range(i, min(i + step, n))) for i in range(0, n, step)]
    k = len(bins)
    if batching.balance and k >= dp_size:
        weights = [sum(lengths[i] for i in b) for b in bins]
        ranks = [sorted(part) for part in karmarkar_karp(weights, dp_size, equal_size=k % dp_size == 0)]
    else:
        ranks = [list(range(r, k, dp_size)) for r in range(dp_size)]
    return [[bins[b] for b in part] for part in ranks]


def rank_packs(samples: list[TrainSample], ids: list[int], dp_size: int, dp_rank: int,
               batching: Batching) -> list[Pack]:
    """This rank's micro-batches of the global batch `ids` (see schedule), packed."""
    mine = schedule([samples[i].tokens.numel() for i in ids], dp_size, batching)[dp_rank]
    return [_pack(samples, [ids[p] for p in positions]) for positions in mine]


def _pack(samples: list[TrainSample], ids: list[int]) -> Pack:
    lengths = [samples[i].tokens.numel() for i in ids]
    cu = torch.zeros(len(ids) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lengths).cumsum(0)
    return Pack(sample_ids=list(ids), tokens=torch.cat([samples[i].tokens for i in ids]), cu_seqlens=cu)


def first_fit_pack(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """First-fit bin packing in order: each bin's sum is at most max_tokens, except a single
    longer item, alone in its own bin."""
    bins: list[list[int]] = []
    sums: list[int] = []
    for i, n in enumerate(lengths):
        for b, used in enumerate(sums):
            if used + n <= max_tokens:
                bins[b].append(i)
                sums[b] += n
                break
        else:
            bins.append([i])
            sums.append(n)
    return bins


def expand_bins_by_splitting(bins: list[list[int]], target: int, lengths: list[int]) -> None:
    """Grow `bins` in place towards `target` bins by splitting the heaviest bin of several items
    into two halves balanced by tokens (longest first to the lighter half); stops when every bin
    holds one item. No new bin is heavier than the one it came from."""
    while len(bins) < target:
        splittable = [(sum(lengths[i] for i in b), k) for k, b in enumerate(bins) if len(b) > 1]
        if not splittable:
            return
        _, k = max(splittable)
        halves: list[list[int]] = [[], []]
        sums = [0, 0]
        for i in sorted(bins[k], key=lambda i: -lengths[i]):
            h = 0 if sums[0] <= sums[1] else 1
            halves[h].append(i)
            sums[h] += lengths[i]
        bins[k] = halves[0]
        bins.append(halves[1])


def karmarkar_karp(weights: list[int], k: int, equal_size: bool) -> list[list[int]]:
    """k-way largest differencing (Karmarkar-Karp), as slime's seqlen_balancing (from verl):
    partitions of the indices of `weights` whose sums differ by at most the largest weight;
    equal_size: every partition gets len(weights) / k items.

    A state is k partial partitions, sorted heaviest first; the two states of largest spread are
    merged, heaviest of one with lightest of the other, until one state is left."""
    if equal_size and len(weights) % k:
        raise ValueError(f"equal_size needs a multiple of {k} items, got {len(weights)}")
    order = sorted((w, i) for i, w in enumerate(weights))
    chunks = [order[j:j + k] for j in range(0, len(order), k)] if equal_size else [[item] for item in order]
    heap = [_State(sorted([_Part(w, [(i, w)]) for w, i in chunk] + [_Part(0, []) for _ in range(k - len(chunk))],
                          reverse=True)) for chunk in chunks]
    heapq.heapify(heap)
    while len(heap) > 1:
        a, b = heapq.heappop(heap).parts, heapq.heappop(heap).parts
        heapq.heappush(heap, _State(sorted((_Part(x.total + y.total, x.items + y.items)
                                            for x, y in zip(a, reversed(b))), reverse=True)))
    return [[i for i, _ in part.items] for part in heap[0].parts]


@dataclass
class _Part:
    """One partial partition, ordered as slime's: by sum, then item count, then items."""

    total: int
    items: list[tuple[int, int]]  # (index, weight)

    def __lt__(self, other: _Part) -> bool:
        return (self.total, len(self.items), self.items) < (other.total, len(other.items), other.items)


@dataclass
class _State:
    """k partial partitions, heaviest first; the heap pops the largest spread first, then the
    one with the heaviest first partition (slime's order)."""

    parts: list[_Part]

    def __lt__(self, other: _State) -> bool:
        spread, other_spread = self.parts[0].total - self.parts[-1].total, other.parts[0].total - other.parts[-1].total
        if spread != other_spread:
            return spread > other_spread
        return other.parts[0] < self.parts[0]


def response_slices(pack: Pack, samples: list[TrainSample]) -> list[slice]:
    """For each sample of the pack, the positions of the pack's logits that predict its response
    tokens (the position before each response token)."""
    out = []
    for k, i in enumerate(pack.sample_ids):
        end = int(pack.cu_seqlens[k + 1])
        start = end - samples[i].response_length
        out.append(slice(start - 1, end - 1))
    return out
