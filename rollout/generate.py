"""generate_rollout: prompt groups from the buffer -> the router -> scored samples.

The round: groups are taken from the buffer, each sample is tokenized and generated (through the
request transport, request_transport.py, which retries, aborts and reports failing engines, so a
round finishes while any engine lives and every sample is returned exactly once), the sample hooks
run and the group is scored (reward_dispatch.py). With dynamic sampling, groups are generated until
enough pass the filter; groups still running then are aborted on the engines and, with
--partial-rollout, go back to the buffer with the tokens they have, to be continued in a later round.

A --custom-generate-function-path returns what takes its argument's place in the group, as in
slime: a Sample (the argument or a new one), or a list of them from one call (a multi-turn agent's
samples), each then of the argument's group; None keeps the argument, filled in place. Users'
functions failing on single samples do not end the round (sample_errors.py): a group with a sample
that failed or came back unfinished never reaches the trainer unless --sample-error-policy
zero_reward gives a failed reward 0. A user function that fails where a restart would fail again
(it does not load, or raises outside any one sample) raises PluginError (plugins.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import inspect
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any
from urllib.parse import urlsplit

from rollout import custom_generate, debug_data, trace
from rollout.buffer import DataBuffer
from rollout.custom_generate import CustomGenerates
from rollout.engine_check import CHECK_TIMEOUT_S
from rollout.engine_client import version_from_wire
from rollout.filters import judge_group
from rollout.plugin_contracts import CustomGenerate, DynamicSamplingFilter, RolloutFunction, SampleHook
from rollout.plugins import load_function, raised
from rollout.remote_rm import RemoteRewardModel
from rollout.request_deadline import DecodeSpeed
from rollout.request_transport import RequestCounts, RequestTransport
from rollout.reward_dispatch import RewardDispatch
from rollout.rollout_output import RolloutFnTrainOutput, train_groups
from rollout.sample import Sample, Status, numbered
from rollout.sample_errors import SampleError, SampleErrors, nothing_trainable

log = logging.getLogger(__name__)

_FINISH = {"stop": Status.COMPLETED, "length": Status.TRUNCATED, "abort": Status.ABORTED}
_DONE = (Status.COMPLETED, Status.TRUNCATED)
SAMPLE_HOOK = "--rollout-sample-hook-path"


class UnfinishedSample(Exception):
    """A custom generate returned a sample that is neither complete nor truncated while the round
    goes on (an aborted one is continued first)."""


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
    # Users' functions failing on single samples: --sample-error-policy, the count, the first reported.
    sample_errors: SampleErrors = field(default_factory=SampleErrors, repr=False)
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
    return run_rollout(args, rollout_id, data_buffer, evaluation).samples


def run_rollout(args: RolloutArgs, rollout_id: int, data_buffer: DataBuffer | None,
                evaluation: bool = False) -> RolloutFnTrainOutput:
    """The rollout's groups and the metrics a --rollout-function-path reported with them."""
    if args.rollout_function_path:
        function: RolloutFunction = load_function(args.rollout_function_path, "--rollout-function-path")
        try:  # slime's call: evaluation by keyword, a data source with get_samples/add_samples
            groups, metrics = train_groups(function(args.for_plugins, rollout_id, data_buffer, evaluation=evaluation))
        except Exception as err:
            raise raised("--rollout-function-path", args.rollout_function_path, err,
                         f"in rollout {rollout_id}") from err
        return RolloutFnTrainOutput(groups, metrics)
    if args.load_debug_rollout_data:
        return RolloutFnTrainOutput(debug_data.load(args.load_debug_rollout_data, rollout_id))
    if data_buffer is None:
        raise ValueError("the built-in rollout draws prompts from a data buffer: give --prompt-data")
    groups = asyncio.run(_Round(args, rollout_id, data_buffer, evaluation).run())
    if args.save_debug_rollout_data:
        debug_data.save(args.save_debug_rollout_data, rollout_id, [s for group in groups for s in group])
    return RolloutFnTrainOutput(groups)


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
        self.generates = CustomGenerates(args.custom_generate_function_path)
        self.remote_rm = (RemoteRewardModel(args.rm_url, concurrency=args.rm_concurrency, timeout_s=args.rm_timeout,
                                            max_retries=args.rm_max_retries, backoff_s=args.rm_retry_backoff)
                          if args.rm_url else None)
        self.errors = args.sample_errors
        self.rewards = RewardDispatch(rm_type=args.rm_type, custom_rm_path=args.custom_rm_path, group_rm=args.group_rm,
                                      plugin_args=args.for_plugins, remote_rm=self.remote_rm, errors=self.errors)
        self.hooks: list[SampleHook] = [load_function(path, SAMPLE_HOOK) for path in args.rollout_sample_hook_path]
        self.keep: DynamicSamplingFilter | None = (
            load_function(args.dynamic_sampling_filter_path, "--dynamic-sampling-filter-path")
                     if args.dynamic_sampling_filter_path and not evaluation else None)
        self.finished_samples = 0  # of groups done (kept, filtered out or dropped), not left over
        self.failed: list[SampleError] = []  # users' functions' errors on those samples
        self.dropped_groups = self.scored_groups = 0  # finished groups dropped for those errors, or scored

    async def run(self) -> list[list[Sample]]:
        target = self.args.rollout_batch_size
        batch = self.args.over_sampling_batch_size or target  # more than target: the first to finish are kept
        kept: list[list[Sample]] = []
        async with self.transport, self.remote_rm or contextlib.nullcontext():
            running: set[asyncio.Task[list[Sample] | None]] = set()
            while len(kept) < target:
                if not running:
                    self._stop_if_nothing_trainable()  # else another batch would fail the same way
                    running = {asyncio.create_task(self._group(g)) for g in self.buffer.get(batch)}
                finished, running = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                for left, task in enumerate(finished, 1):
                    group = task.result()
                    if group is None:
                        continue  # dropped: a user function failed on one of its samples
                    # groups kept or still able to be: slime's keep_when_insufficient counts them
                    candidates = len(kept) + len(running) + len(finished) - left + 1
                    if self.keep is None or self._judge(group, candidates, target):
                        kept.append(group)
            self.transport.stop()
            leftovers = await self._abort(running) if running else []
        self._stop_if_nothing_trainable()
        kept.sort(key=lambda g: numbered(g[0].group_index))
        for group in kept[target:]:
            leftovers.append(group)  # finished beyond the target: not wasted with partial rollout
        if self.args.partial_rollout:
            self.buffer.add(sorted(leftovers, key=lambda g: numbered(g[0].group_index)))
        return kept[:target]

    async def _abort(self, running: set[asyncio.Task[list[Sample] | None]]) -> list[list[Sample]]:
        """Abort what is still generating; its groups come back with the tokens they have."""
        await self.transport.abort_all()
        return [group for group in await asyncio.gather(*running) if group is not None]

    def _judge(self, group: list[Sample], candidates: int, target: int) -> bool:
        assert self.keep is not None
        try:
            return judge_group(self.keep, self.args.for_plugins, group, candidates, target)
        except Exception as err:
            raise raised("--dynamic-sampling-filter-path", self.args.dynamic_sampling_filter_path or "", err,
                         f"on group {group[0].group_index} of rollout {self.rollout_id}") from err

    async def _group(self, group: list[Sample]) -> list[Sample] | None:
        """The group generated, through the hooks and scored; None when it is dropped because a
        user function failed on one of its samples (sample_errors.py)."""
        slots = await asyncio.gather(*(self._sample(s) for s in group))
        samples = [s for slot in slots if slot is not None for s in slot]
        failed_slots = sum(slot is None for slot in slots)
        if failed_slots:
            self._drop(group[0].group_index, len(samples) + failed_slots, failed_slots)
            return None
        if not all(s.status in _DONE for s in samples):
            if self.transport.stopped:
                return samples  # the round ended: partial rollout continues it in a later round
            self._drop(group[0].group_index, len(samples), self._unfinished(samples))
            return None
        hooked = [await self._run_hooks(s) for s in samples]
        if any(s is None for s in hooked):
            self._drop(group[0].group_index, len(samples), sum(s is None for s in hooked))
            return None
        samples = [s for s in hooked if s is not None]
        failed = await self.rewards.score_group(samples)
        self.failed += [error for _, error in failed]
        if failed and self.errors.drops_groups:
            self._drop(samples[0].group_index, len(samples), len(failed))
            return None
        self.finished_samples += len(samples)
        self.scored_groups += 1
        for sample, error in failed:
            self.errors.zero_reward(sample, error, self.args.reward_key)
        return samples

    def _drop(self, group_index: int | None, finished: int, failed: int) -> None:
        """A group that cannot be trained on: `failed` of its `finished` samples failed (recorded)."""
        self.finished_samples += finished
        self.dropped_groups += 1
        log.info("rollout %d: group %d dropped: %d of its %d samples failed or came back unfinished",
                 self.rollout_id, group_index, failed, finished)

    def _unfinished(self, samples: list[Sample]) -> int:
        """Samples left unfinished while the round goes on: errors of the custom generate that
        returned them (an engine's abort at the length limit, with the built-in one, is no one's)."""
        unfinished = [s for s in samples if s.status not in _DONE and self.generates.for_sample(s) is not None]
        for sample in unfinished:
            self._record(*self.generates.named(sample), sample, UnfinishedSample(
                f"sample {sample.index} came back with status {sample.status.value}: set sample.status to "
                "COMPLETED or TRUNCATED (ABORTED is continued)"))
        return len(unfinished)

    def _record(self, flag: str, path: str, sample: Sample, err: Exception) -> None:
        self.failed.append(self.errors.record(flag, path, sample, err))

    def _stop_if_nothing_trainable(self) -> None:
        if self.failed and (len(self.failed) >= self.finished_samples or not self.scored_groups):
            raise nothing_trainable(self.failed, self.finished_samples, self.dropped_groups, self.rollout_id)

    async def _run_hooks(self, sample: Sample) -> Sample | None:
        """--rollout-sample-hook-path, in order, before the reward: a hook may return a new sample.
        None: a hook raised (recorded)."""
        for path, hook in zip(self.args.rollout_sample_hook_path, self.hooks):
            try:
                out = hook(self.args.for_plugins, sample, rollout_id=self.rollout_id, evaluation=self.evaluation)
                out = await out if inspect.isawaitable(out) else out
            except Exception as err:
                self._record(SAMPLE_HOOK, path, sample, err)
                return None
            if out is not None:  # a new sample stands in the argument's place
                out.group_index = sample.group_index
                out.index = sample.index if out.index is None else out.index
                sample = out
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

    async def _sample(self, sample: Sample) -> list[Sample] | None:
        """Generate one sample: what takes its place in the group (itself, or what the custom
        generate returned), or None when the custom generate failed on it (recorded)."""
        if sample.status in _DONE:
            return [sample]  # finished in an earlier round of a partial rollout
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
            generate = self.generates.for_sample(sample)
            if generate is not None:
                returned = await self._custom_generate(generate, sample)
                if returned is None or len(returned) > 1:
                    return returned  # several samples from one call: each must be finished
                sample = returned[0]
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
                return [sample]  # (a sample the round ended before it started stays PENDING, for partial rollout)

    async def _custom_generate(self, generate: CustomGenerate, sample: Sample) -> list[Sample] | None:
        """One call of the sample's custom generate: the samples it returned, each of `sample`'s
        group, or None when it raised or returned what is not samples (recorded)."""
        try:
            async with self.transport.gate:  # a plug-in's requests count against --rollout-concurrency too
                with trace.span(sample, "generate", attempt=trace.generate_attempts(sample), custom=True) as span:
                    returned = await custom_generate.call(generate, self.args.for_plugins, sample,
                                                          self._sampling_params(sample), self.evaluation)
                    span.update(weight_version=returned[0].weight_version, outcome=returned[0].status.value)
        except Exception as err:
            self._record(*self.generates.named(sample), sample, err)
            return None
        return returned

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
