"""One group of prompts generated: each sample through the engines (the built-in /generate, sent by
the request transport) or the --custom-generate-function-path, then the --rollout-sample-hook-path
hooks, then the reward (reward_dispatch.py). Used by the round (generate.py) and by the fully
asynchronous worker (fully_async.py).

A custom generate (--custom-generate-function-path, or an eval set's own) returns what takes its
argument's place in the group, as in slime (custom_generate.py). Users'
functions failing on single samples do not end the round (sample_errors.py): a group with a sample
that failed or came back unfinished never reaches the trainer unless --sample-error-policy
zero_reward gives a failed reward 0. A sample an engine aborted (a weight update's pause) is
continued from its tokens, unless generation has ended (`ended`): the group then comes back with
its aborted samples, for partial rollout or the fully asynchronous worker to continue or requeue.
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import logging
import time
from collections.abc import Callable
from functools import lru_cache
from typing import Any

from rollout import custom_generate, trace
from rollout.custom_generate import CustomGenerates
from rollout.engine_client import version_from_wire
from rollout.plugin_contracts import CustomGenerate, SampleHook
from rollout.plugins import load_function
from rollout.remote_rm import RemoteRewardModel
from rollout.request_transport import RequestTransport
from rollout.reward_dispatch import RewardDispatch
from rollout.rollout_args import RolloutArgs
from rollout.sample import Sample, Status
from rollout.sample_errors import SampleError

log = logging.getLogger(__name__)

_FINISH = {"stop": Status.COMPLETED, "length": Status.TRUNCATED, "abort": Status.ABORTED}
DONE = (Status.COMPLETED, Status.TRUNCATED)
SAMPLE_HOOK = "--rollout-sample-hook-path"


class UnfinishedSample(Exception):
    """A custom generate returned a sample that is neither complete nor truncated while the round
    goes on (an aborted one is continued first)."""


@lru_cache(maxsize=4)
def _tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _seed(*parts: object) -> int:
    """A stable per-sample sampling seed, so a resumed run samples exactly as an uninterrupted one."""
    return int.from_bytes(hashlib.sha256(":".join(map(str, parts)).encode()).digest()[:4], "little")


def _oldest(sample: Sample, before: int | None, sent: int | None) -> None:
    """The oldest version of its tokens: its earlier tokens', the one served when the request was
    sent, the one that answered."""
    versions = [v for v in (before, sent, sample.weight_version) if v is not None]
    sample.oldest_weight_version = min(versions) if versions else None


class GroupGenerator:
    """Generates groups for one round (rollout_id) or for the fully asynchronous worker, and counts
    what the round's checks need: samples finished, users' functions' errors, groups dropped or scored."""

    def __init__(self, args: RolloutArgs, transport: RequestTransport, rollout_id: int, evaluation: bool,
                 halted: Callable[[], bool] = lambda: False,
                 served_version: Callable[[], int | None] = lambda: None) -> None:
        """halted: generation ends for another reason than the transport's stop (the fully
        asynchronous worker's pause with mode abort, or its stop). served_version: the version
        the engines serve as a request is sent (None: not known; the answer's is used), so a
        request that spans a weight update counts from the older one."""
        self.args, self.transport, self.rollout_id, self.evaluation, self.halted = (
            args, transport, rollout_id, evaluation, halted)
        self.served_version = served_version
        self.tokenizer = _tokenizer(args.hf_checkpoint)
        self.generates = CustomGenerates(args.custom_generate_function_path)
        self.remote_rm = (RemoteRewardModel(args.rm_url, concurrency=args.rm_concurrency, timeout_s=args.rm_timeout,
                                            max_retries=args.rm_max_retries, backoff_s=args.rm_retry_backoff)
                          if args.rm_url else None)
        self.errors = args.sample_errors
        self.rewards = RewardDispatch(rm_type=args.rm_type, custom_rm_path=args.custom_rm_path, group_rm=args.group_rm,
                                      plugin_args=args.for_plugins, remote_rm=self.remote_rm, errors=self.errors)
        self.hooks: list[SampleHook] = [load_function(path, SAMPLE_HOOK) for path in args.rollout_sample_hook_path]
        self.finished_samples = 0  # of groups done (kept, filtered out or dropped), not left over
        self.failed: list[SampleError] = []  # users' functions' errors on those samples
        self.dropped_groups = self.scored_groups = 0  # finished groups dropped for those errors, or scored

    @property
    def ended(self) -> bool:
        """Nothing more is generated: an aborted sample is not continued."""
        return self.transport.stopped or self.halted()

    async def group(self, group: list[Sample]) -> list[Sample] | None:
        """The group generated, through the hooks and scored; None when it is dropped because a
        user function failed on one of its samples (sample_errors.py)."""
        slots = await asyncio.gather(*(self._sample(s) for s in group))
        samples = [s for slot in slots if slot is not None for s in slot]
        failed_slots = sum(slot is None for slot in slots)
        if failed_slots:
            self._drop(group[0].group_index, len(samples) + failed_slots, failed_slots)
            return None
        if not all(s.status in DONE for s in samples):
            if self.ended:
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
        unfinished = [s for s in samples if s.status not in DONE and self.generates.for_sample(s) is not None]
        for sample in unfinished:
            self._record(*self.generates.named(sample), sample, UnfinishedSample(
                f"sample {sample.index} came back with status {sample.status.value}: set sample.status to "
                "COMPLETED or TRUNCATED (ABORTED is continued)"))
        return len(unfinished)

    def _record(self, flag: str, path: str, sample: Sample, err: Exception) -> None:
        self.failed.append(self.errors.record(flag, path, sample, err))

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
        if sample.status in DONE:
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
            if sample.status is Status.ABORTED and not self.ended:  # stopped earlier, continued now
                trace.add(sample, "resume", time.time(), weight_version=sample.weight_version,
                          rollout_id=self.rollout_id, tokens=sample.response_length)
            before = sample.generating_version if sample.response_length else None
            sent = self.served_version()
            generate = self.generates.for_sample(sample)
            if generate is not None:
                returned = await self._custom_generate(generate, sample)
                if returned is None:
                    return None
                for new in returned:
                    _oldest(new, before, sent)
                if len(returned) > 1:
                    return returned  # several samples from one call: each must be finished
                sample = returned[0]
            else:
                body = await self.transport.generate(sample, self._rid(sample), self._sampling_params(sample))
                if body is not None:  # None: the round ended while the request waited its turn
                    self._apply(sample, body)
                    _oldest(sample, before, sent)
            if sample.status is Status.ABORTED:
                trace.add(sample, "abort", time.time(), weight_version=sample.weight_version,
                          tokens=sample.response_length)
            # Aborted by someone else (a weight update's pause): continue where it stopped.
            if (sample.status is not Status.ABORTED or self.ended
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
