"""Which reward a finished sample gets, by slime's order: --custom-rm-path (per sample, or per group
with --group-rm), else the sample's or --rm-type's built-in type (rollout.rewards), whose
remote_rm is the reward server at --rm-url (rollout.remote_rm). A custom RM that raises fails only
its sample (or, with --group-rm, its group's): rollout.sample_errors records it."""

from __future__ import annotations

import asyncio
import inspect
from typing import Any

from rollout import rewards, trace
from rollout.errors import RolloutError
from rollout.plugin_contracts import RewardFunction
from rollout.plugins import PluginError, load_function
from rollout.remote_rm import RemoteRewardModel
from rollout.sample import Sample
from rollout.sample_errors import SampleError, SampleErrors

SET_RM = "--eval-config custom_rm_path"
Failed = list[tuple[Sample, SampleError]]  # samples the custom RM raised on, left without a reward


class _Raised:
    """The custom RM raised on the sample (its error is recorded): no reward."""

    def __init__(self, error: SampleError) -> None:
        self.error = error


class RewardDispatch:
    def __init__(self, *, rm_type: str | None, custom_rm_path: str | None, group_rm: bool, plugin_args: Any,
                 remote_rm: RemoteRewardModel | None, errors: SampleErrors | None = None) -> None:
        """plugin_args: what a custom reward function gets as `args`; remote_rm: opened by the
        caller; errors: where a custom RM's errors are recorded."""
        self.rm_type, self.custom_rm_path, self.group_rm = rm_type, custom_rm_path, group_rm
        self.plugin_args, self.remote_rm = plugin_args, remote_rm
        self.errors = errors or SampleErrors()
        self.custom_rm: RewardFunction | None = (load_function(custom_rm_path, "--custom-rm-path") if custom_rm_path
                                                 else None)
        self._set_rms: dict[str, RewardFunction] = {}  # eval sets' custom_rm_path, loaded once

    async def score_group(self, group: list[Sample]) -> Failed:
        """Set the reward of each sample of a finished group (a custom generate may have scored
        some already: those keep theirs, unless --group-rm scores the group whole). Returns the
        samples the custom RM raised on, which have no reward."""
        if self.group_rm:
            scored, values = group, await self._group_rewards(group)
        else:
            scored = [s for s in group if s.reward is None]
            values = list(await asyncio.gather(*(self._reward(s) for s in scored)))
        failed: Failed = []
        for sample, value in zip(scored, values):
            if isinstance(value, _Raised):
                failed.append((sample, value.error))
            else:
                sample.reward = value
        return failed

    async def _group_rewards(self, group: list[Sample]) -> list[Any]:
        """--group-rm: slime's batched contract, the custom RM gets the whole group and returns a
        list; built-in types score each sample."""
        if not self.custom_rm:
            return list(await asyncio.gather(*(self._reward(s) for s in group)))
        try:
            with trace.span(group, "reward", group_rm=True):
                values = await self._call_custom_rm(group)
        except Exception as err:  # the whole group's reward failed
            return [self._raised(s, err) for s in group]
        if not isinstance(values, (list, tuple)) or len(values) != len(group):
            raise PluginError(f"--custom-rm-path {self.custom_rm_path} with --group-rm must return one reward "
                              f"per sample of the group (a list of {len(group)}), got {values!r:.200}",
                              "--custom-rm-path", self.custom_rm_path or "")
        return list(values)

    async def _reward(self, sample: Sample) -> Any:
        try:
            with trace.span(sample, "reward"):
                return await self._score(sample)
        except Exception as err:
            if not (self.custom_rm or sample.custom_rm_path):
                raise  # a built-in reward's failure (a reward server's) is the rollout's
            return self._raised(sample, err)

    def _raised(self, sample: Sample, err: Exception) -> _Raised:
        flag, path = ((SET_RM, sample.custom_rm_path) if sample.custom_rm_path
                      else ("--custom-rm-path", self.custom_rm_path or ""))
        return _Raised(self.errors.record(flag, path, sample, err))

    async def _call_custom_rm(self, arg: Sample | list[Sample], rm: RewardFunction | None = None) -> Any:
        rm = rm or self.custom_rm
        assert rm is not None
        value = rm(self.plugin_args, arg)
        return await value if inspect.isawaitable(value) else value

    async def _score(self, sample: Sample) -> Any:
        if sample.custom_rm_path:  # an eval set's own (--eval-config), as slime's async_rm: first
            if sample.custom_rm_path not in self._set_rms:
                self._set_rms[sample.custom_rm_path] = load_function(sample.custom_rm_path, SET_RM)
            return await self._call_custom_rm(sample, self._set_rms[sample.custom_rm_path])
        if self.custom_rm:
            return await self._call_custom_rm(sample)
        if rewards.sample_type(self.rm_type, sample.metadata).removeprefix("boxed_") == rewards.REMOTE:
            if self.remote_rm is None:
                raise RolloutError(f"sample {sample.index}: rm_type remote_rm needs --rm-url (the reward server)")
            return await self.remote_rm.reward(sample)
        # In a thread: sympy's grading can take a while, and requests keep flowing meanwhile.
        return await asyncio.to_thread(rewards.rule_based_reward, self.rm_type, sample.response, sample.label,
                                       sample.metadata)
