"""slime.rollout.rm_hub: the reward calls slime's plug-ins make themselves (multi_agent scores its
agents' samples with batched_async_rm), by slime's order: the sample's own custom_rm_path (an eval
set's), else --custom-rm-path, else the sample's metadata rm_type or --rm-type (slurmrl's built-in
rewards, rollout.rewards; remote_rm posts to --rm-url)."""

from __future__ import annotations

import asyncio
import inspect
from typing import Any

from rollout.math_grading import extract_answer as extract_boxed_answer
from rollout.math_grading import grade_answer_verl
from rollout.remote_rm import RemoteRewardModel
from rollout.rewards import REMOTE, rule_based_reward, sample_type
from rollout.sample import Sample
from slime.rollout.rm_hub.math_dapo_utils import compute_score as compute_score_dapo
from slime.utils.misc import load_function

__all__ = ["async_rm", "batched_async_rm", "compute_score_dapo", "extract_boxed_answer", "grade_answer_verl",
           "remote_rm"]


async def _called(function: Any, *args: Any, **kwargs: Any) -> Any:
    value = function(*args, **kwargs)
    return await value if inspect.isawaitable(value) else value


async def remote_rm(args: Any, sample: Sample, max_retries: int = 10) -> Any:
    """POST {prompt, response, label} to --rm-url; the JSON answer is the reward (retried)."""
    async with RemoteRewardModel(args.rm_url, max_retries=max_retries,
                                 timeout_s=getattr(args, "rm_timeout", 120.0)) as model:
        return await model.reward(sample)


async def async_rm(args: Any, sample: Sample, **kwargs: Any) -> Any:
    """One sample's reward."""
    path = sample.custom_rm_path or getattr(args, "custom_rm_path", None)
    if path is not None:
        return await _called(load_function(path), args, sample, **kwargs)
    metadata = sample.metadata if isinstance(sample.metadata, dict) else {}
    if sample_type(getattr(args, "rm_type", None), metadata).removeprefix("boxed_") == REMOTE:
        return await remote_rm(args, sample)
    # in a thread, as the rollout's own scoring: sympy's grading can take a while
    return await asyncio.to_thread(rule_based_reward, getattr(args, "rm_type", None), sample.response, sample.label,
                                   metadata)


async def batched_async_rm(args: Any, samples: list[Sample], **kwargs: Any) -> list[Any]:
    """The rewards of several samples: --custom-rm-path gets them all at once (slime's batch mode),
    else each is scored by async_rm."""
    if getattr(args, "custom_rm_path", None) is not None:
        return list(await _called(load_function(args.custom_rm_path), args, samples, **kwargs))
    return list(await asyncio.gather(*(async_rm(args, sample, **kwargs) for sample in samples)))
