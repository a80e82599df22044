"""Sampling parameters (SGLang's names, defaults and checks) and next-token sampling for one row."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

# SGLang treats a temperature below this as greedy decoding.
_GREEDY_TEMPERATURE = 1e-6
_LOGPROB_FLOOR = torch.finfo(torch.float32).min  # JSON has no -inf

# SGLang sampling fields this engine does not implement: accepted only at their defaults.
_UNSUPPORTED_DEFAULTS: dict[str, Any] = {
    "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0, "json_schema": None,
    "regex": None, "ebnf": None, "structural_tag": None, "stop_regex": None, "custom_params": None,
    "logit_bias": None, "stream_interval": None, "spaces_between_special_tokens": True,
}


class SamplingError(ValueError):
    """A sampling parameter has a bad value (a 400 with {"error": {"message": ...}})."""


class UnknownSamplingField(ValueError):
    """A key SGLang does not know (a 400 with {"error": "unknown field ..."})."""


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    min_new_tokens: int = 0
    n: int = 1
    sampling_seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_TEMPERATURE or self.top_k == 1


_FIELDS = tuple(SamplingParams.__dataclass_fields__)


def parse_sampling_params(raw: Any, vocab_size: int) -> SamplingParams:
    """Check a request's sampling_params dict the way SGLang does and return it resolved."""
    if raw is None:
        return SamplingParams()
    if not isinstance(raw, dict):
        raise SamplingError(f"sampling_params must be an object, got {type(raw).__name__}")
    for key in raw:
        if key not in _FIELDS and key not in _UNSUPPORTED_DEFAULTS:
            raise UnknownSamplingField(f"unknown field `{key}` in sampling_params, expected one of "
                                       f"{', '.join(_FIELDS + tuple(_UNSUPPORTED_DEFAULTS))}")
        if key in _UNSUPPORTED_DEFAULTS and raw[key] != _UNSUPPORTED_DEFAULTS[key]:
            raise SamplingError(f"sampling param {key} is not supported by the CPU engine "
                                f"(only its default {_UNSUPPORTED_DEFAULTS[key]!r})")
    values = {k: v for k, v in raw.items() if k in _FIELDS and v is not None}
    defaults = SamplingParams()
    max_new = _int(values, "max_new_tokens", defaults.max_new_tokens, minimum=0)
    min_new = _int(values, "min_new_tokens", 0, minimum=0)
    if min_new > max_new:
        raise SamplingError(f"min_new_tokens ({min_new}) must not exceed max_new_tokens ({max_new})")
    top_k = _int(values, "top_k", -1, minimum=-1)
    if top_k == 0:
        raise SamplingError("top_k must be -1 (disabled) or at least 1, got 0")
    top_p = _float(values, "top_p", 1.0)
    if not 0.0 < top_p <= 1.0:
        raise SamplingError(f"top_p must be in (0, 1], got {top_p}")
    min_p = _float(values, "min_p", 0.0)
    if not 0.0 <= min_p <= 1.0:
        raise SamplingError(f"min_p must be in [0, 1], got {min_p}")
    temperature = _float(values, "temperature", 1.0)
    if temperature < 0.0:
        raise SamplingError(f"temperature must be 0 or more, got {temperature}")
    stop = values.get("stop", ())
    stop = (stop,) if isinstance(stop, str) else stop
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
        raise SamplingError("stop must be a non-empty string or a list of them")
    stop_ids = values.get("stop_token_ids", ())
    if not isinstance(stop_ids, (list, tuple)) or not all(_is_int(t) and 0 <= t < vocab_size for t in stop_ids):
        raise SamplingError(f"stop_token_ids must be a list of token ids in [0, {vocab_size})")
    seed = values.get("sampling_seed")
    if seed is not None and not _is_int(seed):
        raise SamplingError(f"sampling_seed must be an integer, got {seed!r}")
    return SamplingParams(
        max_new_tokens=max_new, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
        stop=tuple(stop), stop_token_ids=frozenset(stop_ids), ignore_eos=_bool(values, "ignore_eos", False),
        skip_special_tokens=_bool(values, "skip_special_tokens", True),
        no_stop_trim=_bool(values, "no_stop_trim", False), min_new_tokens=min_new,
        n=_int(values, "n", 1, minimum=1), sampling_seed=seed,
    )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int(values: dict, key: str, default: int, minimum: int) -> int:
    value = values.get(key, default)
    if not _is_int(value) or value < minimum:
        raise SamplingError(f"{key} must be an integer >= {minimum}, got {value!r}")
    return value


def _float(values: dict, key: str, default: float) -> float:
    value = values.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SamplingError(f"{key} must be a number, got {value!r}")
    return float(value)


def _bool(values: dict, key: str, default: bool) -> bool:
    value = values.get(key, default)
    if not isinstance(value, bool):
        raise SamplingError(f"{key} must be true or false, got {value!r}")
    return value


@dataclass(frozen=True)
class Draw:
    token: int
    logprob: float
    top: list[tuple[float, int]]


def sample_next(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator,
                banned: frozenset[int], top_logprobs_num: int) -> Draw:
    """Pick the next token from one row of float32 logits.

    Logprobs follow SGLang's sampler: greedy rows report log_softmax(logits); sampled rows report
    the log of the temperature-scaled distribution renormalised over top_p (top_k and min_p
    narrow what is drawn but do not enter the logprobs). `banned` tokens (stop tokens before
    min_new_tokens) are masked out first, as SGLang's min_new_tokens penalizer does."""
    if banned:
        logits = logits.clone()
        logits[list(banned)] = float("-inf")
    if params.greedy:
        logprobs = torch.log_softmax(logits, dim=-1)
        token = int(torch.argmax(logits))
    else:
        probs = torch.softmax(logits / params.temperature, dim=-1)
        sorted_probs, order = probs.sort(descending=True)
        if params.top_p >= 1.0:
            # SGLang samples without top-p then: a float32 cumulative sum passes 1.0 before the
            # last tokens in about one row in five, which would drop them and renormalise the rest.
            nucleus = sorted_probs
            logprobs = torch.log_softmax(logits / params.temperature, dim=-1)
        else:
            # Drop a token when the mass before it already reaches top_p, as SGLang does.
            outside_top_p = (sorted_probs.cumsum(0) - sorted_probs) > params.top_p
            nucleus = sorted_probs.masked_fill(outside_top_p, 0.0)
            logprobs = torch.zeros_like(probs).scatter_(0, order, nucleus / nucleus.sum()).log()
        drawable = nucleus.clone()
        if params.top_k > 0:
            drawable[params.top_k:] = 0.0
        if params.min_p > 0.0:
            drawable[drawable < sorted_probs[0] * params.min_p] = 0.0
        token = int(order[torch.multinomial(drawable, 1, generator=generator)])
    logprobs = logprobs.clamp(min=_LOGPROB_FLOOR)
    top: list[tuple[float, int]] = []
    if top_logprobs_num > 0:
        values, ids = logprobs.topk(min(top_logprobs_num, logprobs.numel()))
        top = list(zip(values.tolist(), ids.tolist()))
    return Draw(token=token, logprob=float(logprobs[token]), top=top)
