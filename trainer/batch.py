"""What one training step consumes: per-sample tensors, and micro-batches that pack several
samples into one sequence (so --seq-length never caps a sample's context).

A sample's tokens are prompt + response; its response has `response_length` tokens, and the
log-prob of response token j is read from the logits at the position before it. Every
per-response tensor (loss mask, advantages, log-probs) has response_length entries.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from rollout.sample import Sample


@dataclass
class TrainSample:
    tokens: Tensor  # int64 [L]: prompt, then response
    response_length: int
    loss_mask: Tensor  # float32 [R]
    reward: float
    rollout_log_probs: Tensor | None = None  # [R], from the engine
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
    def from_sample(cls, sample: Sample, reward_key: str | None = None) -> TrainSample:
        """reward_key (--reward-key): which entry of a dict reward is trained on."""
        r = sample.response_length
        logp = torch.tensor(sample.rollout_log_probs, dtype=torch.float32) if sample.rollout_log_probs else None
        return cls(tokens=torch.tensor(sample.tokens, dtype=torch.int64), response_length=r,
                   loss_mask=torch.tensor(sample.loss_mask[:r] or [1] * r, dtype=torch.float32),
                   reward=sample.reward_value(reward_key), rollout_log_probs=logp)


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
        self.position_ids = torch.cat([torch.arange(n) for n in lengths]) if lengths else torch.zeros(0, dtype=torch.int64)

    @property
    def num_tokens(self) -> int:
        return self.tokens.numel()


def make_packs(samples: list[TrainSample], ids: list[int], max_tokens: int) -> list[Pack]:
    """Greedy packing in the given order: each pack holds at most max_tokens tokens, except a
    single sample longer than that, which gets a pack of its own."""
    packs: list[Pack] = []
    current: list[int] = []
    used = 0
    for i in ids:
        n = samples[i].tokens.numel()
        if current and used + n > max_tokens:
            packs.append(_pack(samples, current))
            current, used = [], 0
        current.append(i)
        used += n
    if current:
        packs.append(_pack(samples, current))
    return packs


def _pack(samples: list[TrainSample], ids: list[int]) -> Pack:
    lengths = [samples[i].tokens.numel() for i in ids]
    cu = torch.zeros(len(ids) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lengths).cumsum(0)
    return Pack(sample_ids=list(ids), tokens=torch.cat([samples[i].tokens for i in ids]), cu_seqlens=cu)


def split_for_data_parallel(samples: list[TrainSample], ids: list[int], dp_size: int) -> list[list[int]]:
    """Split sample ids over data-parallel ranks, balancing tokens (largest first to the lightest
    rank); each rank's ids keep their original order, so the split is deterministic."""
    loads = [0] * dp_size
    shares: list[list[int]] = [[] for _ in range(dp_size)]
    for i in sorted(ids, key=lambda i: (-samples[i].tokens.numel(), i)):
        rank = min(range(dp_size), key=lambda r: (loads[r], r))
        shares[rank].append(i)
        loads[rank] += samples[i].tokens.numel()
    return [sorted(share) for share in shares]


def response_slices(pack: Pack, samples: list[TrainSample]) -> list[slice]:
    """For each sample of the pack, the positions of the pack's logits that predict its response
    tokens (the position before each response token)."""
    out = []
    for k, i in enumerate(pack.sample_ids):
        end = int(pack.cu_seqlens[k + 1])
        start = end - samples[i].response_length
        out.append(slice(start - 1, end - 1))
    return out
