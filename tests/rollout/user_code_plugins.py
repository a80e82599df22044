"""Users' functions for the tests of custom generate return values and of users' code failing
(tests/rollout/test_custom_generate_return.py, test_user_code_errors.py): generates that answer
without an engine, as a slime user writes them, and functions that raise."""

from __future__ import annotations

import copy

from rollout.sample import Sample

FAIL_EVERY = 5  # the flaky RM raises on samples whose index is a multiple of this
RAISED: list[int] = []  # the samples the flaky functions raised on


def _answer(sample: Sample, answer: str) -> Sample:
    sample.response = answer
    sample.tokens = sample.tokens + [5, 6]
    sample.response_length, sample.loss_mask, sample.rollout_log_probs = 2, [1, 1], [-0.5, -0.5]
    sample.status = Sample.Status.COMPLETED
    return sample


async def new_sample(args, sample: Sample, sampling_params) -> Sample:
    """Returns a new Sample and leaves its argument untouched (slime takes the return value)."""
    answer = sample.label if sample.index % 2 == 0 else "0"
    return _answer(copy.deepcopy(sample), answer)


async def fan_out(args, sample: Sample, sampling_params) -> list[Sample]:
    """A multi-turn agent's shape: two samples from one call (one per turn), the second a new object."""
    first = _answer(sample, sample.label)
    second = _answer(Sample(index=sample.index, group_index=-1, prompt=sample.prompt, label=sample.label,
                            tokens=list(sample.tokens[:-2])), "0")
    return [first, second]


async def in_place(args, sample: Sample, sampling_params) -> None:
    """Fills its argument and returns nothing: kept working as it did."""
    _answer(sample, sample.label)


async def forgets_status(args, sample: Sample, sampling_params) -> Sample:
    """Returns a response but leaves odd samples' status PENDING (unfinished)."""
    new = _answer(copy.deepcopy(sample), sample.label)
    if sample.index % 2:
        new.status = Sample.Status.PENDING
    return new


async def returns_a_dict(args, sample: Sample, sampling_params) -> dict:
    return {"text": "not a sample"}


async def calls_a_missing_method(args, sample: Sample, sampling_params) -> Sample:
    """A slime plug-in calling what slurmrl's Sample does not have."""
    sample.get_multimodal_train_inputs()  # type: ignore[attr-defined]
    return sample


def flaky_rm(args, sample: Sample) -> float:
    """The toy reward, but raising on every FAIL_EVERY-th sample."""
    if sample.index % FAIL_EVERY == 0:
        RAISED.append(sample.index)
        raise ValueError(f"cannot grade sample {sample.index}")
    return float(sample.response.strip() == str(sample.label))


def broken_rm(args, sample: Sample) -> float:
    raise KeyError("score")


def unreachable_rm(args, sample: Sample) -> float:
    raise ConnectionRefusedError("the grading service at 127.0.0.1:9 refused the connection")


def flaky_group_rm(args, samples: list[Sample]) -> list[float]:
    if samples[0].group_index % 2:
        raise ValueError(f"cannot grade group {samples[0].group_index}")
    return [1.0] * len(samples)


def rollout_calls_a_missing_method(args, rollout_id, data_buffer, evaluation=False):
    """A --rollout-function-path that calls what slurmrl's data buffer does not have."""
    return data_buffer.get_samples_by_difficulty(args.rollout_batch_size)


def rollout_cannot_connect(args, rollout_id, data_buffer, evaluation=False):
    raise ConnectionError("the agent server is down")


def hook_raises_on_odd(args, sample: Sample, *, rollout_id=None, evaluation=False) -> None:
    if sample.index % 2:
        raise RuntimeError(f"hook failed on {sample.index}")
