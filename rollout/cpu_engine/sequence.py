"""One sequence being generated: its tokens, KV cache, sampling state, and when it is finished."""

from __future__ import annotations

import time
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any

import torch

from rollout.cpu_engine.codec import Codec
from rollout.cpu_engine.kv_batch import SequenceCache, cached_length
from rollout.cpu_engine.sampling import Draw, SamplingParams


@dataclass(eq=False)
class Sequence:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator
    return_logprob: bool = False
    top_logprobs_num: int = 0
    internal: bool = False  # the engine's own warmup or health probe: bypasses weight-update holds, never logged
    created: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    kv: SequenceCache | None = None  # per layer (or a hybrid model's own cache), the first `cached_len` tokens
    finish_reason: dict[str, Any] | None = None
    weight_version: str = ""
    finished_at: float = 0.0
    done: Future = field(default_factory=Future)  # resolved with the sequence once it is finished

    @property
    def cached_len(self) -> int:
        return cached_length(self.kv)

    def pending_tokens(self) -> list[int]:
        """Tokens not yet in the KV cache: the prompt at first, then the last sampled token."""
        return (self.prompt_ids + self.output_ids)[self.cached_len:]

    def banned_tokens(self, eos_ids: frozenset[int]) -> frozenset[int]:
        """Stop tokens may not be drawn before min_new_tokens."""
        if len(self.output_ids) >= self.params.min_new_tokens:
            return frozenset()
        return eos_ids | self.params.stop_token_ids

    def append(self, draw: Draw) -> None:
        self.output_ids.append(draw.token)
        if self.return_logprob:
            self.output_logprobs.append(draw.logprob)
            if self.top_logprobs_num:
                self.output_top_logprobs.append(draw.top)

    def check_finished(self, eos_ids: frozenset[int], codec: Codec) -> dict[str, Any] | None:
        """The finish reason after the last appended token, in SGLang's order: length, then
        stop tokens (unless ignore_eos), then stop strings."""
        params = self.params
        if len(self.output_ids) >= params.max_new_tokens:
            return {"type": "length", "length": params.max_new_tokens}
        if len(self.output_ids) < params.min_new_tokens:
            return None
        last = self.output_ids[-1]
        if not params.ignore_eos and (last in eos_ids or last in params.stop_token_ids):
            return {"type": "stop", "matched": last}
        if params.stop:
            text = codec.decode(self.output_ids, params.skip_special_tokens)
            for stop in params.stop:
                if stop in text:
                    return {"type": "stop", "matched": stop}
        return None

    def finish(self, reason: dict[str, Any], weight_version: str) -> None:
        self.finish_reason = reason
        self.weight_version = weight_version
        self.finished_at = time.monotonic()
        self.kv = None
        try:
            self.done.set_result(self)
        except InvalidStateError:  # its HTTP handler gave up waiting
            pass

    def output_text(self, codec: Codec) -> str:
        """The decoded output, trimmed of a matched stop token or stop string unless no_stop_trim."""
        matched = (self.finish_reason or {}).get("matched")
        ids = self.output_ids
        if not self.params.no_stop_trim and isinstance(matched, int):
            ids = ids[:-1]
        text = codec.decode(ids, self.params.skip_special_tokens)
        if not self.params.no_stop_trim and isinstance(matched, str) and matched in text:
            text = text[:text.index(matched)]
        return text
