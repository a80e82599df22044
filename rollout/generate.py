"""generate_rollout: prompt groups from the buffer -> the router -> scored samples.

The round: groups are taken from the buffer, each sample is tokenized and generated (through the
request transport, request_transport.py, which retries, aborts and reports failing engines, so a
round finishes while any engine lives and every sample is returned exactly once), the sample hooks
run and the group is scored (reward_dispatch.py). With dynamic sampling, groups are generated until
enough pass the filter; groups still running then are aborted on the engines and, with
--partial-rollout, go back to the buffer with the tokens they have, to be continued in a later round.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import inspect
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any
from urllib.parse import urlsplit

from rollout import debug_data, trace
from rollout.buffer import DataBuffer
from rollout.engine_check import CHECK_TIMEOUT_S
from rollout.engine_client import version_from_wire
from rollout.filters import judge_group
from rollout.plugins import load_function
from rollout.remote_rm import RemoteRewardModel
from rollout.request_deadline import DecodeSpeed
from rollout.request_transport import RequestCounts, RequestTransport
from rollout.reward_dispatch import RewardDispatch
from rollout.sample import Sample, Status

_FINISH = {"stop": Status.COMPLETED, "length": Status.TRUNCATED, "abort": Status.ABORTED}


@dataclass
class RolloutArgs:
    """The rollout's share of the job's flags (slime's names)."""

    hf_checkpoint: str  # where the tokenizer comes from
    router_url: str  # http://{--sglang-router-ip}:{--sglang-router-port}
    api_key: str | None = None  # the job's key, for the router and the engines
    rollout_batch_size: int = 32  # groups (prompts) per rollout
    n_samples_per_prompt: int = 4
    rollout_max_response_len: int = 64
    rollout_temperature: float = 1.0
    rollout_top_p: float = 1.0
    rollout_top_k: int = -1
    rollout_stop: list[str] | None = None
    rollout_stop_token_ids: list[int] | None = None
    rollout_skip_special_tokens: bool = False  # slime's default: the response text keeps them
    rollout_seed: int = 42
    rollout_concurrency: int = 64  # requests in flight at once
    apply_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)  # for prompts given as messages
    rm_type: str | None = None  # built-in reward: rewards.REWARD_TYPES, each with an optional boxed_ prefix
    custom_rm_path: str | None = None  # async f(args, sample) -> reward; with group_rm, f(args, samples) -> list
    group_rm: bool = False  # score a group at once, when all its samples are done
    reward_key: str | None = None  # the entry of a dict reward that is trained on
    rm_url: str | None = None  # remote_rm's reward server
    rm_concurrency: int = 64  # reward requests in flight at once
    rm_timeout: float = 120.0  # seconds for one reward request
    rm_max_retries: int = 10  # attempts per sample before the rollout fails
    rm_retry_backoff: float = 1.0  # seconds before the first retry; doubles, capped at 30 s
    custom_generate_function_path: str | None = None
    rollout_function_path: str | None = None
    over_sampling_batch_size: int | None = None  # groups started per batch with dynamic sampling
    dynamic_sampling_filter_path: str | None = None
    partial_rollout: bool = False
    mask_offpolicy_in_partial_rollout: bool = False  # a continued sample trains only on its new tokens
    rollout_sample_hook_path: list[str] = field(default_factory=list)  # hook(args, sample, *, rollout_id, evaluation)
    save_debug_rollout_data: str | None = None  # path with {rollout_id}
    load_debug_rollout_data: str | None = None
    retry_timeout_s: float = 1800.0  # give up on a request after this long without any engine
    router_timeout_s: float = 10.0  # one call to the router's worker API (the job's router_request_timeout)
    # Called with an engine url the router could not reach; default: remove it from the router.
    engine_failure_handler: Callable[[str], None] | None = field(default=None, repr=False)
    # Called with (engine url, why) for an engine that holds requests past their deadline or answers
    # what does not parse, while it may pass its probes; default: remove it from the router.
    engine_unresponsive_handler: Callable[[str, str], None] | None = field(default=None, repr=False)
    decode_speed: DecodeSpeed = field(default_factory=DecodeSpeed, repr=False)  # kept across rounds
    request_counts: RequestCounts = field(default_factory=RequestCounts, repr=False)  # requests retried, all rounds
    engine_check_timeout_s: float = CHECK_TIMEOUT_S  # one engine's 1-token check (engine_check.py)
    # What plug-ins get as `args`: the trainer's whole parsed flags, by slime's names (its
    # sglang_router_ip/port, hf_checkpoint...); None: this object.
    plugin_args: Any = field(default=None, repr=False)

    @property
    def for_plugins(self) -> Any:
        return self if self.plugin_args is None else self.plugin_args

    @property
    def sglang_router_ip(self) -> str:
        return urlsplit(self.router_url).hostname or ""

    @property
    def sglang_router_port(self) -> int | None:
        return urlsplit(self.router_url).port


def generate_rollout(args: RolloutArgs, rollout_id: int, data_buffer: DataBuffer | None,
                     evaluation: bool = False) -> list[list[Sample]]:
    """data_buffer is None only where --rollout-function-path supplies every prompt."""
    if args.rollout_function_path:
        return load_function(args.rollout_function_path, "--rollout-function-path")(
            args.for_plugins, rollout_id, data_buffer, evaluation)
    if args.load_debug_rollout_data:
        return debug_data.load(args.load_debug_rollout_data, rollout_id)
    if data_buffer is None:
        raise ValueError("the built-in rollout draws prompts from a data buffer: give --prompt-data")
    groups = asyncio.run(_Round(args, rollout_id, data_buffer, evaluation).run())
    if args.save_debug_rollout_data:
        debug_data.save(args.save_debug_rollout_data, rollout_id, [s for group in groups for s in group])
    return groups


@lru_cache(maxsize=4)
def _tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _seed(*parts: object) -> int:
    """A stable per-sample sampling seed, so a resumed run samples exactly as an uninterrupted one."""
    return int.from_bytes(hashlib.sha256(":".join(map(str, parts)).encode()).digest()[:4], "little")


class _Round:
    def __init__(self, args: RolloutArgs, rollout_id: int, buffer: DataBuffer, evaluation: bool) -> None:
        self.args, self.rollout_id, self.buffer, self.evaluation = args, rollout_id, buffer, evaluation
        self.tokenizer = _tokenizer(args.hf_checkpoint)
        self.transport = RequestTransport(
            args.router_url, args.api_key, router_timeout_s=args.router_timeout_s,
            concurrency=args.rollout_concurrency, retry_timeout_s=args.retry_timeout_s,
            check_timeout_s=args.engine_check_timeout_s, decode_speed=args.decode_speed, counts=args.request_counts,
            on_failure=args.engine_failure_handler, on_unresponsive=args.engine_unresponsive_handler)
        self.custom_generate = (load_function(args.custom_generate_function_path, "--custom-generate-function-path")
                                if args.custom_generate_function_path else None)
        self.remote_rm = (RemoteRewardModel(args.rm_url, concurrency=args.rm_concurrency, timeout_s=args.rm_timeout,
                                            max_retries=args.rm_max_retries, backoff_s=args.rm_retry_backoff)
                          if args.rm_url else None)
        self.rewards = RewardDispatch(rm_type=args.rm_type, custom_rm_path=args.custom_rm_path, group_rm=args.group_rm,
                                      plugin_args=args.for_plugins, remote_rm=self.remote_rm)
        self.hooks = [load_function(path, "--rollout-sample-hook-path") for path in args.rollout_sample_hook_path]
        self.keep = (load_function(args.dynamic_sampling_filter_path, "--dynamic-sampling-filter-path")
                     if args.dynamic_sampling_filter_path and not evaluation else None)

    async def run(self) -> list[list[Sample]]:
        target = self.args.rollout_batch_size
        batch = self.args.over_sampling_batch_size or target  # more than target: the first to finish are kept
        kept: list[list[Sample]] = []
        async with self.transport, self.remote_rm or contextlib.nullcontext():
            running: set[asyncio.Task[list[Sample]]] = set()
            while len(kept) < target:
                if not running:
                    running = {asyncio.create_task(self._group(g)) for g in self.buffer.get(batch)}
                finished, running = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                for left, task in enumerate(finished, 1):
                    group = task.result()
                    # groups kept or still able to be: slime's keep_when_insufficient counts them
                    candidates = len(kept) + len(running) + len(finished) - left + 1
                    if self.keep is None or judge_group(self.keep, self.args.for_plugins, group, candidates, target):
                        kept.append(group)
            self.transport.stop()
            leftovers = await self._abort(running) if running else []
        kept.sort(key=lambda g: g[0].group_index)
        for group in kept[target:]:
            leftovers.append(group)  # finished beyond the target: not wasted with partial rollout
        if self.args.partial_rollout:
            self.buffer.add(sorted(leftovers, key=lambda g: g[0].group_index))
        return kept[:target]

    async def _abort(self, running: set[asyncio.Task[list[Sample]]]) -> list[list[Sample]]:
        """Abort what is still generating; its groups come back with the tokens they have."""
        await self.transport.abort_all()
        return list(await asyncio.gather(*running))

    async def _group(self, group: list[Sample]) -> list[Sample]:
        await asyncio.gather(*(self._sample(s) for s in group))
        if all(s.status in (Status.COMPLETED, Status.TRUNCATED) for s in group):
            for i, sample in enumerate(group):
                group[i] = await self._run_hooks(sample)
            await self.rewards.score_group(group)
        return group

    async def _run_hooks(self, sample: Sample) -> Sample:
        """--rollout-sample-hook-path, in order, before the reward: a hook may return a new sample."""
        for hook in self.hooks:
            out = hook(self.args.for_plugins, sample, rollout_id=self.rollout_id, evaluation=self.evaluation)
            out = await out if inspect.isawaitable(out) else out
            sample = sample if out is None else out
        return sample

    def _sampling_params(self, sample: Sample) -> dict[str, Any]:
        params: dict[str, Any] = {
            "max_new_tokens": self.args.rollout_max_response_len - sample.response_length,
            "temperature": self.args.rollout_temperature,  # an eval's args carry its set's
            "top_p": self.args.rollout_top_p, "top_k": self.args.rollout_top_k,
            "sampling_seed": _seed(self.args.rollout_seed, self.rollout_id, sample.index, sample.response_length)}
        if self.args.rollout_stop:
            params["stop"] = self.args.rollout_stop
        if self.args.rollout_stop_token_ids:
            params["stop_token_ids"] = self.args.rollout_stop_token_ids
        # slime's: special tokens and matched stop strings stay in the text the reward reads
        params.update(skip_special_tokens=self.args.rollout_skip_special_tokens, no_stop_trim=True)
        return params

    async def _sample(self, sample: Sample) -> None:
        if sample.status in (Status.COMPLETED, Status.TRUNCATED):
            return  # finished in an earlier round of a partial rollout
        if not sample.tokens:
            prompt = sample.prompt
            if not isinstance(prompt, str):
                prompt = self.tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True,
                                                            **self.args.apply_chat_template_kwargs)
            sample.tokens = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        if sample.response_length and self.args.mask_offpolicy_in_partial_rollout:
            sample.loss_mask = [0] * len(sample.loss_mask)  # generated by an older policy, in an earlier round
        while True:
            if sample.status is Status.ABORTED and not self.transport.stopped:  # stopped earlier, continued now
                trace.add(sample, "resume", time.time(), weight_version=sample.weight_version,
                          rollout_id=self.rollout_id, tokens=sample.response_length)
            if self.custom_generate:
                async with self.transport.gate:  # a plug-in's requests count against --rollout-concurrency too
                    with trace.span(sample, "generate", attempt=trace.generate_attempts(sample), custom=True) as span:
                        await self.custom_generate(self.args.for_plugins, sample, self._sampling_params(sample))
                        span.update(weight_version=sample.weight_version, outcome=sample.status.value)
            else:
                body = await self.transport.generate(sample, self._rid(sample), self._sampling_params(sample))
                if body is not None:  # None: the round ended while the request waited its turn
                    self._apply(sample, body)
            if sample.status is Status.ABORTED:
                trace.add(sample, "abort", time.time(), weight_version=sample.weight_version,
                          tokens=sample.response_length)
            # Aborted by someone else (a weight update's pause): continue where it stopped.
            if (sample.status is not Status.ABORTED or self.transport.stopped
                    or sample.response_length >= self.args.rollout_max_response_len):
                return  # (a sample the round ended before it started stays PENDING, for partial rollout)

    def _rid(self, sample: Sample) -> str:
        """The request's id (an engine aborts by it): the round, the sample and where it starts."""
        kind = "e" if self.evaluation else "r"
        return f"{kind}{self.rollout_id}-s{sample.index}-t{sample.response_length}"

    @staticmethod
    def _apply(sample: Sample, body: dict[str, Any]) -> None:
        meta = body["meta_info"]
        out = body["output_ids"]
        sample.tokens += out
        sample.response += body["text"]
        sample.response_length += len(out)
        sample.loss_mask += [1] * len(out)
        sample.rollout_log_probs += [lp for lp, _, _ in meta.get("output_token_logprobs", [])]
        sample.weight_version = version_from_wire(meta.get("weight_version"))
        sample.status = _FINISH[meta["finish_reason"]["type"]]
