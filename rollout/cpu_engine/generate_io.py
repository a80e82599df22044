"""/generate's request body -> sequences, and finished sequences -> its response, as SGLang does."""

from __future__ import annotations

import random
import uuid
from dataclasses import dataclass
from typing import Any

import torch

from rollout.cpu_engine.codec import Codec
from rollout.cpu_engine.sampling import SamplingError, SamplingParams, UnknownSamplingField, parse_sampling_params
from rollout.cpu_engine.sequence import Sequence


class GenerateError(Exception):
    """A bad /generate request; `body` is the 400 answer."""

    def __init__(self, body: dict[str, Any]) -> None:
        super().__init__(str(body))
        self.body = body


def _bad(message: str) -> GenerateError:
    return GenerateError({"error": {"message": message}})


@dataclass
class GenerateRequest:
    seqs: list[Sequence]
    single: bool  # answer one object, not a list (one prompt and n == 1)


def parse_generate(body: Any, codec: Codec, vocab_size: int, context_len: int,
                   seeds: random.Random) -> GenerateRequest:
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    if body.get("stream"):
        raise _bad("stream is not supported by the CPU engine; send stream=false")
    prompts, batched = _prompts(body, codec, vocab_size)
    params = _sampling_params(body.get("sampling_params"), len(prompts), vocab_size)
    n = params[0].n
    if any(p.n != n for p in params):
        raise _bad("every prompt of a batch must use the same n")
    rids = _rids(body.get("rid"), len(prompts), n)
    return_logprob = _per_prompt(body, "return_logprob", False, len(prompts), lambda v: isinstance(v, bool))
    top_logprobs = _per_prompt(body, "top_logprobs_num", 0, len(prompts),
                               lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0)
    if any(return_logprob) and body.get("logprob_start_len") not in (None, -1):
        raise _bad("logprob_start_len other than -1 (input token logprobs) is not supported by the CPU engine")
    seqs = []
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        if len(prompt) + p.max_new_tokens >= context_len:
            raise _bad(f"Requested token count exceeds the model's maximum context length of {context_len} "
                       f"tokens: prompt {i} has {len(prompt)} tokens and max_new_tokens is {p.max_new_tokens}.")
        for j in range(n):
            # Copy j of n draws from sampling_seed + j: reproducible, yet the n samples differ.
            seed = p.sampling_seed + j if p.sampling_seed is not None else seeds.getrandbits(63)
            seqs.append(Sequence(rid=rids[i * n + j], prompt_ids=prompt, params=p,
                                 generator=torch.Generator().manual_seed(seed),
                                 return_logprob=return_logprob[i], top_logprobs_num=top_logprobs[i]))
    return GenerateRequest(seqs=seqs, single=not batched and n == 1)


def _prompts(body: dict, codec: Codec, vocab_size: int) -> tuple[list[list[int]], bool]:
    text: Any = body.get("text")  # either, checked below
    input_ids: Any = body.get("input_ids")
    if text is None and input_ids is None:
        raise _bad("Either text, input_ids or input_embeds should be provided.")
    if text is not None and input_ids is not None:
        raise _bad("Either text or input_ids should be provided, not both.")
    if text is not None:
        batched = isinstance(text, list)
        texts = text if batched else [text]
        if not texts or not all(isinstance(t, str) for t in texts):
            raise _bad("text must be a string or a non-empty list of strings")
        prompts = [codec.encode(t) for t in texts]
    else:
        batched = isinstance(input_ids, list) and bool(input_ids) and isinstance(input_ids[0], list)
        prompts = input_ids if batched else [input_ids]
        if not isinstance(input_ids, list) or not all(isinstance(p, list) for p in prompts):
            raise _bad("input_ids must be a list of token ids or a list of such lists")
        for prompt in prompts:
            bad = [t for t in prompt if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size]
            if bad:
                raise _bad(f"input_ids holds {bad[0]!r}, not a token id in [0, {vocab_size})")
    if any(not prompt for prompt in prompts):
        raise _bad("a prompt is empty: it must hold at least one token")
    return prompts, batched


def _sampling_params(raw: Any, count: int, vocab_size: int) -> list[SamplingParams]:
    items = raw if isinstance(raw, list) else [raw] * count
    if len(items) != count:
        raise _bad(f"sampling_params is a list of {len(items)}, the batch has {count} prompts")
    try:
        return [parse_sampling_params(item, vocab_size) for item in items]
    except UnknownSamplingField as err:
        raise GenerateError({"error": str(err)}) from err
    except SamplingError as err:
        raise _bad(str(err)) from err


def _rids(rid: Any, count: int, n: int) -> list[str]:
    """One id per sequence. A string rid names a lone sequence; for several it becomes
    rid_0, rid_1, ... (SGLang's scheme; /abort_request with rid then reaches them all)."""
    if rid is None:
        return [uuid.uuid4().hex for _ in range(count * n)]
    if isinstance(rid, str) and rid:
        return [rid] if count * n == 1 else [f"{rid}_{k}" for k in range(count * n)]
    if isinstance(rid, list) and len(rid) == count and all(isinstance(r, str) and r for r in rid):
        return [r if n == 1 else f"{r}_{j}" for r in rid for j in range(n)]
    raise _bad("rid must be a non-empty string, or a list of them as long as the batch")


def _per_prompt(body: dict, key: str, default: Any, count: int, valid) -> list[Any]:
    value = body.get(key)
    values = [default] * count if value is None else value if isinstance(value, list) else [value] * count
    if len(values) != count or not all(valid(v) for v in values):
        raise _bad(f"{key} has a bad value {value!r}")
    return values


def render(seq: Sequence, codec: Codec) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "id": seq.rid,
        "finish_reason": seq.finish_reason,
        "prompt_tokens": len(seq.prompt_ids),
        "completion_tokens": len(seq.output_ids),
        "cached_tokens": 0,  # no prefix cache: every prompt is computed anew
        "weight_version": seq.weight_version,
        "e2e_latency": seq.finished_at - seq.created,
    }
    if seq.return_logprob:
        meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(seq.output_logprobs, seq.output_ids)]
        if seq.top_logprobs_num:
            meta["output_top_logprobs"] = [[[lp, t, None] for lp, t in step] for step in seq.output_top_logprobs]
    return {"text": seq.output_text(codec), "output_ids": list(seq.output_ids), "meta_info": meta}
