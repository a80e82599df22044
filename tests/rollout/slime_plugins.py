"""Plug-ins written against slime's contracts, as slime's docs give them: the tests load them by name."""

import copy

from transformers import AutoTokenizer

from rollout.rewards import toy_reward
from slime.rollout.filter_hub.base_types import DynamicFilterOutput
from slime.utils.http_utils import post
from slime.utils.types import Sample

TOKENIZER = None


# The seed doc's custom generate example, verbatim.
async def generate(args, sample: Sample, sampling_params) -> Sample:
    global TOKENIZER
    if TOKENIZER is None:
        TOKENIZER = AutoTokenizer.from_pretrained(args.hf_checkpoint, trust_remote_code=True)
    # send request to router
    output = await post(
        f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate",
        {
            "text": sample.prompt,
            "sampling_params": sampling_params,
        }
    )
    prompt_tokens_ids = TOKENIZER(sample.prompt, add_special_tokens=False)["input_ids"]
    response_token_ids = TOKENIZER(output["text"], add_special_tokens=False)["input_ids"]
    # set sample
    sample.tokens = prompt_tokens_ids + response_token_ids
    sample.response_length = len(response_token_ids)
    sample.truncated = output["meta_info"]["finish_reason"]["type"] == "length"
    sample.response = output["text"]
    sample.aborted = output["meta_info"]["finish_reason"]["type"] == "abort"
    return sample


async def generate_new(args, sample: Sample, sampling_params) -> Sample | list[Sample]:
    """The doc's example run on a copy of its argument, returned as a new Sample (even samples) or a
    list of one (odd ones, a multi-turn agent's shape): slime trains on what comes back."""
    new = await generate(args, copy.deepcopy(sample), sampling_params)
    return new if sample.index % 2 == 0 else [new]


FLAKY_EVERY = 50
FLAKY_SAID = "flaky_toy_rm raises on sample"  # printed (to the trainer's log) at each raise


async def flaky_toy_rm(args, sample: Sample) -> float:
    """The toy task's reward, raising for 1 sample in FLAKY_EVERY (slime's custom RM signature)."""
    if sample.index % FLAKY_EVERY == 7:
        print(f"{FLAKY_SAID} {sample.index}", flush=True)
        raise ValueError(f"cannot grade sample {sample.index}")
    return toy_reward(sample.response, sample.label)


def even_groups_only(args, samples) -> DynamicFilterOutput:
    """A slime-style dynamic filter: its verdict is an object, never a bare bool."""
    keep = samples[0].group_index % 2 == 0
    return DynamicFilterOutput(keep=keep, reason=None if keep else "odd group")


def reject_with_fallback(args, samples) -> DynamicFilterOutput:
    """Drops every group, but lets one fill a rollout that would otherwise need another round."""
    return DynamicFilterOutput(keep=False, reason="always", keep_when_insufficient=True)


async def answer_with_label(args, sample, *, rollout_id=None, evaluation=False):
    """A --rollout-sample-hook-path hook (slime's signature): it rewrites the response before the
    reward reads it, so every sample it ran on scores 1 on the toy task."""
    sample.response = str(sample.label)
    sample.metadata["hooked_at"] = rollout_id
    return sample
