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


# ---- slime's plug-in APIs (tests/rollout/test_slime_apis.py) ------------------------------------
async def generate_with_evaluation(args, sample: Sample, sampling_params, evaluation=False) -> Sample:
    """A custom generate whose signature names evaluation (slime passes it then), answering without
    an engine through append_response_tokens; a new Sample() with no index stands in its place."""
    new = Sample(prompt=sample.prompt, label=sample.label, tokens=list(sample.tokens))
    new.append_response_tokens(args, tokens=[5, 6], log_probs=[-0.5, -0.5], text=str(sample.label),
                               meta_info={"finish_reason": {"type": "stop"}})
    new.metadata["evaluation"] = evaluation
    return new


def rollout_with_metrics(args, rollout_id, data_source, evaluation=False):
    """A --rollout-function-path as slime's newer ones: groups from data_source.get_samples, filled,
    returned as RolloutFnTrainOutput with metrics; the last group given back with add_samples and
    one flat Sample of its own without index or group_index."""
    from slime.rollout.base_types import RolloutFnTrainOutput

    assert evaluation is False
    groups = data_source.get_samples(args.rollout_batch_size + 1)
    data_source.add_samples(groups[-1:])
    for group in groups[:-1]:
        for sample in group:
            sample.append_response_tokens(args, tokens=[5], log_probs=[-1.0], text=str(sample.label),
                                          meta_info={"finish_reason": {"type": "length"}})
            sample.reward = 1.0
    extra = Sample(prompt="extra", tokens=[1, 2], response_length=0, reward=0.0)
    extra.append_response_tokens(args, tokens=[3], log_probs=[-2.0], meta_info={"finish_reason": {"type": "stop"}})
    return RolloutFnTrainOutput(samples=groups[:-1] + [extra], metrics={"my_metric": 7.0})


async def batch_rm(args, samples):
    """slime's batched custom RM: a list in, a list out."""
    return [float(len(s.response)) for s in samples]


async def one_rm(args, sample, **kwargs):
    return 42.0
