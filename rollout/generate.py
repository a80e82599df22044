"""generate_rollout: prompt groups from the buffer -> the router -> scored samples.

Requests go through the router with bounded concurrency. A request whose engine fails is sent
again (the router's 500 names the engine, which is reported once to a failure handler that takes
it out of the router), so a round finishes while any engine lives, and every sample is returned
exactly once. A request past its deadline (request_deadline.py) is aborted and sent again, and an
answer that does not parse is sent again; either way the engines are checked (engine_check.py)
and one that does not answer is reported as unresponsive, though its health probe may pass. With dynamic sampling, groups are generated until enough pass the filter; groups
still running then are aborted on the engines and, with --partial-rollout, go back to the buffer
with the tokens they have, to be continued in a later round.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import inspect
import logging
import random
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from rollout import debug_data, rewards, trace
from rollout.buffer import DataBuffer
from rollout.engine_check import CHECK_TIMEOUT_S, BadAnswer, parse_answer, unanswering
from rollout.engine_client import version_from_wire
from rollout.filters import judge_group
from rollout.plugins import load_function
from rollout.remote_rm import RemoteRewardModel
from rollout.request_deadline import ABORT_GRACE_S, DEADLINE_RECHECK_S, DecodeSpeed
from rollout.router_client import RouterClient, RouterError
from rollout.sample import Sample, Status

log = logging.getLogger(__name__)

# the engine a router error names: "URL: http://h:p" (regular), "for url (http://h:p/generate)" (PD mode)
_UPSTREAM = re.compile(r"(?:URL: |for url \()(https?://[^/\s)]+)")
_ROUTER_AWAY = "the router did not answer"
_FINISH = {"stop": Status.COMPLETED, "length": Status.TRUNCATED, "abort": Status.ABORTED}


class RolloutError(RuntimeError):
    pass


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


def generate_rollout(args: RolloutArgs, rollout_id: int, data_buffer: DataBuffer,
                     evaluation: bool = False) -> list[list[Sample]]:
    if args.rollout_function_path:
        return load_function(args.rollout_function_path, "--rollout-function-path")(
            args.for_plugins, rollout_id, data_buffer, evaluation)
    if args.load_debug_rollout_data:
        return debug_data.load(args.load_debug_rollout_data, rollout_id)
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
        self.router = RouterClient(args.router_url, args.api_key, args.router_timeout_s)
        self.reported: set[str] = set()
        self.checking: asyncio.Task | None = None  # one engine check at a time, shared by the requests that wait
        self.done = False  # enough groups: stop continuing aborted samples
        self.custom_generate = (load_function(args.custom_generate_function_path, "--custom-generate-function-path")
                                if args.custom_generate_function_path else None)
        self.custom_rm = load_function(args.custom_rm_path, "--custom-rm-path") if args.custom_rm_path else None
        self.remote_rm = (RemoteRewardModel(args.rm_url, concurrency=args.rm_concurrency, timeout_s=args.rm_timeout,
                                            max_retries=args.rm_max_retries, backoff_s=args.rm_retry_backoff)
                          if args.rm_url else None)
        self.hooks = [load_function(path, "--rollout-sample-hook-path") for path in args.rollout_sample_hook_path]
        self.keep = (load_function(args.dynamic_sampling_filter_path, "--dynamic-sampling-filter-path")
                     if args.dynamic_sampling_filter_path and not evaluation else None)

    async def run(self) -> list[list[Sample]]:
        target = self.args.rollout_batch_size
        batch = self.args.over_sampling_batch_size or target  # more than target: the first to finish are kept
        headers = {"Authorization": f"Bearer {self.args.api_key}"} if self.args.api_key else {}
        self.gate = asyncio.Semaphore(self.args.rollout_concurrency)
        kept: list[list[Sample]] = []
        async with (aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=None)) as self.http,
                    self.remote_rm or contextlib.nullcontext()):
            running: set[asyncio.Task] = set()
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
            self.done = True
            leftovers = await self._abort(running) if running else []
        kept.sort(key=lambda g: g[0].group_index)
        for group in kept[target:]:
            leftovers.append(group)  # finished beyond the target: not wasted with partial rollout
        if self.args.partial_rollout:
            self.buffer.add(sorted(leftovers, key=lambda g: g[0].group_index))
        return kept[:target]

    async def _abort(self, running: set[asyncio.Task]) -> list[list[Sample]]:
        """Abort what is still generating (the router does not forward aborts: each engine gets one)."""
        for url in await asyncio.to_thread(lambda: list(self.router.workers())):
            try:
                async with self.http.post(url + "/abort_request", json={"abort_all": True}):
                    pass
            except aiohttp.ClientError:
                pass  # an engine that cannot be reached has nothing running for us either
        return list(await asyncio.gather(*running))

    async def _group(self, group: list[Sample]) -> list[Sample]:
        await asyncio.gather(*(self._sample(s) for s in group))
        if all(s.status in (Status.COMPLETED, Status.TRUNCATED) for s in group):
            for i, sample in enumerate(group):
                group[i] = await self._run_hooks(sample)
            if self.args.group_rm:
                scored, values = group, await self._group_rewards(group)
            else:
                scored = [s for s in group if s.reward is None]  # a custom generate may have scored its sample
                values = await asyncio.gather(*(self._reward(s) for s in scored))
            for sample, value in zip(scored, values):
                sample.reward = value
        return group

    async def _run_hooks(self, sample: Sample) -> Sample:
        """--rollout-sample-hook-path, in order, before the reward: a hook may return a new sample."""
        for hook in self.hooks:
            out = hook(self.args.for_plugins, sample, rollout_id=self.rollout_id, evaluation=self.evaluation)
            out = await out if inspect.isawaitable(out) else out
            sample = sample if out is None else out
        return sample

    async def _group_rewards(self, group: list[Sample]) -> list[Any]:
        """--group-rm: slime's batched contract, the custom RM gets the whole group and returns a
        list; built-in types score each sample."""
        if not self.custom_rm:
            return list(await asyncio.gather(*(self._reward(s) for s in group)))
        with trace.span(group, "reward", group_rm=True):
            values = self.custom_rm(self.args.for_plugins, group)
            values = await values if inspect.isawaitable(values) else values
        if not isinstance(values, (list, tuple)) or len(values) != len(group):
            raise RolloutError(f"--custom-rm-path {self.args.custom_rm_path} with --group-rm must return one reward "
                               f"per sample of the group (a list of {len(group)}), got {values!r:.200}")
        return list(values)

    async def _reward(self, sample: Sample) -> Any:
        with trace.span(sample, "reward"):
            return await self._score(sample)

    async def _score(self, sample: Sample) -> Any:
        if self.custom_rm:
            value = self.custom_rm(self.args.for_plugins, sample)
            return await value if inspect.isawaitable(value) else value
        if rewards.sample_type(self.args.rm_type, sample.metadata).removeprefix("boxed_") == rewards.REMOTE:
            if self.remote_rm is None:
                raise RolloutError(f"sample {sample.index}: rm_type remote_rm needs --rm-url (the reward server)")
            return await self.remote_rm.reward(sample)
        # In a thread: sympy's grading can take a while, and requests keep flowing meanwhile.
        return await asyncio.to_thread(rewards.rule_based_reward, self.args.rm_type, sample.response, sample.label,
                                       sample.metadata)

    def _sampling_params(self, sample: Sample) -> dict[str, Any]:
        params = {"max_new_tokens": self.args.rollout_max_response_len - sample.response_length,
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
            if sample.status is Status.ABORTED and not self.done:  # stopped earlier, continued now
                trace.add(sample, "resume", time.time(), weight_version=sample.weight_version,
                          rollout_id=self.rollout_id, tokens=sample.response_length)
            if self.custom_generate:
                async with self.gate:  # a plug-in's requests count against --rollout-concurrency too
                    with trace.span(sample, "generate", attempt=trace.generate_attempts(sample), custom=True) as span:
                        await self.custom_generate(self.args.for_plugins, sample, self._sampling_params(sample))
                        span.update(weight_version=sample.weight_version, outcome=sample.status.value)
            elif (body := await self._post(sample)) is not None:
                self._apply(sample, body)
            if sample.status is Status.ABORTED:
                trace.add(sample, "abort", time.time(), weight_version=sample.weight_version,
                          tokens=sample.response_length)
            # Aborted by someone else (a weight update's pause): continue where it stopped.
            if sample.status is not Status.ABORTED or self.done or sample.response_length >= self.args.rollout_max_response_len:
                return  # (a sample the round ended before it started stays PENDING, for partial rollout)

    async def _post(self, sample: Sample) -> dict[str, Any] | None:
        """The engine's answer; None if the round ended while this request waited its turn."""
        kind = "e" if self.evaluation else "r"
        rid = f"{kind}{self.rollout_id}-s{sample.index}-t{sample.response_length}"
        params = self._sampling_params(sample)
        deadline, backoff, attempt = time.monotonic() + self.args.retry_timeout_s, 0.2, 0
        while True:
            queued = time.time()
            async with self.gate:
                trace.add(sample, "queued", queued, time.time())
                if self.done:
                    return None  # enough groups: nothing new starts once engines were told to abort
                attempt += 1
                payload = {"rid": rid if attempt == 1 else f"{rid}-a{attempt}", "input_ids": sample.tokens,
                           "sampling_params": params, "return_logprob": True}
                spans, started, began = trace.generate_attempts(sample), time.monotonic(), time.time()
                status, text = await self._within_deadline(payload, params["max_new_tokens"])
            span = trace.add(sample, "generate", began, time.time(), attempt=spans, rid=payload["rid"])
            if status == 200:
                try:
                    body = parse_answer(text)
                except BadAnswer as err:
                    status, text = None, f"an answer that does not parse: {err}"
                else:
                    self.args.decode_speed.observe(len(body["output_ids"]), time.monotonic() - started)
                    meta = body.get("meta_info") or {}
                    span.update(weight_version=version_from_wire(meta.get("weight_version")),
                                outcome=(meta.get("finish_reason") or {}).get("type"))
                    return body
            url = _UPSTREAM.search(text)
            # The engine is known only when the router's error names it: its answers do not.
            span.update(engine=url and url.group(1), outcome=f"HTTP {status}" if status else "no answer",
                        error=text[:200])
            if status is not None and status < 500 and status != 429:
                raise RolloutError(f"router refused sample {sample.index}: {status} {text[:300]}")
            if url and url.group(1) not in self.reported:
                self.reported.add(url.group(1))
                await asyncio.to_thread(self._report_failure, url.group(1))
            lost = status is None and not text.startswith(_ROUTER_AWAY)  # past its deadline, or unparseable
            if lost:  # the router does not say which engine it was: ask each
                log.warning("sample %d: %s (attempt %d); checking the engines and sending it again",
                            sample.index, text[:300], attempt)
                await self._check_engines(text)
            if time.monotonic() > deadline:
                raise RolloutError(f"sample {sample.index}: no engine answered for {self.args.retry_timeout_s:.0f} s "
                                   f"(last: {status} {text[:200]})")
            if lost:
                continue  # at once: the check took its time, and the engine at fault is out
            with trace.span(sample, "retry_wait", attempt=spans):
                await asyncio.sleep(backoff * (1 + random.random()))  # backoff, jittered so retries spread out
            backoff = min(backoff * 2, 5.0)

    async def _within_deadline(self, payload: dict[str, Any], max_new_tokens: int) -> tuple[int | None, str]:
        """(status, text) of the router's answer; (None, why) when it is away or past the deadline,
        which is computed again as speeds are seen. Past it, the engines are told to abort the
        request: a live one answers with the tokens it has (the sample continues from them)."""
        started = time.monotonic()
        request = asyncio.create_task(self._send(payload))
        limit = self.args.decode_speed.deadline_s(max_new_tokens)
        while not request.done() and (left := started + limit - time.monotonic()) > 0:
            await asyncio.wait({request}, timeout=min(left, DEADLINE_RECHECK_S))
            limit = self.args.decode_speed.deadline_s(max_new_tokens)
        if not request.done():
            await self._abort_everywhere(payload["rid"])
            await asyncio.wait({request}, timeout=ABORT_GRACE_S)
        if request.done():
            return request.result()
        request.cancel()
        return None, (f"no answer within its deadline of {limit:.0f} s "
                      f"({max_new_tokens} tokens at most), nor {ABORT_GRACE_S:g} s after an abort")

    async def _send(self, payload: dict[str, Any]) -> tuple[int | None, str]:
        try:
            async with self.http.post(self.args.router_url + "/generate", json=payload) as response:
                return response.status, await response.text()
        except (aiohttp.ClientError, asyncio.TimeoutError) as err:
            return None, f"{_ROUTER_AWAY}: {err}"  # it will be relaunched

    async def _abort_everywhere(self, rid: str) -> None:
        """SGLang's /abort_request for one rid, to every engine (the router does not forward it)."""
        async def abort(url: str) -> None:
            try:
                async with asyncio.timeout(ABORT_GRACE_S):
                    async with self.http.post(url + "/abort_request", json={"rid": rid}):
                        pass
            except (aiohttp.ClientError, TimeoutError):
                pass  # a wedged or dead engine: the check names it
        try:
            urls = await asyncio.to_thread(lambda: list(self.router.workers()))
        except RouterError:
            return  # the router is away: so is the request it held
        await asyncio.gather(*(abort(url) for url in urls))

    async def _check_engines(self, why: str) -> None:
        """Check every engine the router lists (one check at a time; a request that fails meanwhile
        waits for the running one) and report each that does not answer, once a round."""
        if self.checking is None or self.checking.done():
            self.checking = asyncio.create_task(self._check_once(why))
        await asyncio.shield(self.checking)

    async def _check_once(self, why: str) -> None:
        try:
            urls = await asyncio.to_thread(lambda: [u for u in self.router.workers() if u not in self.reported])
        except RouterError as err:
            log.warning("could not list the engines to check them: %s", err)
            return
        for url, failure in (await unanswering(self.http, urls, self.args.engine_check_timeout_s)).items():
            self.reported.add(url)
            reason = f"{why}; then {failure}"
            log.warning("engine %s does not answer: %s", url, reason)
            try:
                await asyncio.to_thread(self._report_unresponsive, url, reason)
            except RouterError as err:  # the router is away (relaunched with the ready engines only)
                log.warning("could not take %s out of the router: %s", url, err)

    def _report_unresponsive(self, url: str, reason: str) -> None:
        if self.args.engine_unresponsive_handler:
            self.args.engine_unresponsive_handler(url, reason)
        else:
            self.router.remove_worker(url)

    def _report_failure(self, url: str) -> None:
        if self.args.engine_failure_handler:
            self.args.engine_failure_handler(url)
        else:
            self.router.remove_worker(url)

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
