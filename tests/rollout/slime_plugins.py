"""Plug-ins written against slime's contracts, as slime's docs give them: the tests load them by name."""

from slime.rollout.filter_hub.base_types import DynamicFilterOutput
from slime.utils.http_utils import post
from slime.utils.types import Sample
from transformers import AutoTokenizer

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
