"""Plug-ins written against slime's contracts, as slime's docs give them: the tests load them by name."""

from __future__ import annotations

import aiohttp
from transformers import AutoTokenizer

from rollout.filters import DynamicFilterOutput

TOKENIZER = None


async def generate(args, sample, sampling_params):
    """The seed doc's custom generate example, with aiohttp standing in for slime's `post` helper
    (and the job's key, which slime's router does not ask for)."""
    global TOKENIZER
    if TOKENIZER is None:
        TOKENIZER = AutoTokenizer.from_pretrained(args.hf_checkpoint, trust_remote_code=True)
    headers = {"Authorization": f"Bearer {args.api_key}"}
    async with aiohttp.ClientSession(headers=headers) as session:
        async with session.post(f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate",
                                json={"text": sample.prompt, "sampling_params": sampling_params}) as answer:
            output = await answer.json()
    prompt_tokens_ids = TOKENIZER(sample.prompt, add_special_tokens=False)["input_ids"]
    response_token_ids = TOKENIZER(output["text"], add_special_tokens=False)["input_ids"]
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
