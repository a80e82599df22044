"""Plug-ins for the reward tests, as a slime user writes them: a custom generate that answers
without an engine (the reward is what is under test), and custom RMs per sample and per group."""

from __future__ import annotations

from rollout.sample import Sample

CALLS: list[list[int]] = []  # the sample indices each group RM call got


async def answer_by_index(args, sample: Sample, sampling_params) -> Sample:
    """Even samples answer the label, odd ones a wrong number, boxed, after the thinking."""
    answer = sample.label if sample.index % 2 == 0 else "0"
    sample.response = f"<think>so</think> \\boxed{{{answer}}}"
    sample.tokens = sample.tokens + [5, 6]
    sample.response_length, sample.loss_mask = 2, [1, 1]
    sample.status = Sample.Status.COMPLETED
    return sample


async def answer_and_score(args, sample: Sample, sampling_params) -> Sample:
    """A generate that scores its own sample (slime's multi-turn agents do): left as it is."""
    await answer_by_index(args, sample, sampling_params)
    sample.reward = 7.0
    return sample


async def group_rank(args, samples: list[Sample]) -> list[float]:
    """--group-rm: a reward that needs the whole group, the sample's rank by index within it."""
    CALLS.append([s.index for s in samples])
    order = sorted(samples, key=lambda s: s.index)
    return [float(order.index(s)) for s in samples]


def group_rank_sync(args, samples: list[Sample]) -> list[float]:
    CALLS.append([s.index for s in samples])
    return [float(i) for i in range(len(samples))]


async def group_too_short(args, samples: list[Sample]) -> list[float]:
    return [1.0]


async def per_sample(args, sample: Sample) -> dict[str, float]:
    return {"score": float(sample.index), "length": float(len(sample.response))}
