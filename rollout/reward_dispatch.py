"""Which reward a finished sample gets, by slime's order: --custom-rm-path (per sample, or per group
with --group-rm), else the sample's or --rm-type's built-in type (rollout.rewards), whose
remote_rm is the reward server at --rm-url (rollout.remote_rm)."""

from __future__ import annotations

import asyncio
import inspect
from typing import Any

from rollout import rewards, trace
from rollout.errors import RolloutError
from rollout.plugins import load_function
from rollout.remote_rm import RemoteRewardModel
from rollout.sample import Sample


class RewardDispatch:
    def __init__(self, *, rm_type: str | None, custom_rm_path: str | None, group_rm: bool, plugin_args: Any,
                 remote_rm: RemoteRewardModel | None) -> None:
        """plugin_args: what a custom reward function gets as `args`; remote_rm: opened by the caller."""
        self.rm_type, self.custom_rm_path, self.group_rm = rm_type, custom_rm_path, group_rm
        self.plugin_args, self.remote_rm = plugin_args, remote_rm
        self.custom_rm = load_function(custom_rm_path, "--custom-rm-path") if custom_rm_path else None

    async def score_group(self, group: list[Sample]) -> None:
        """Set the reward of each sample of a finished group (a custom generate may have scored
        some already: those keep theirs, unless --group-rm scores the group whole)."""
        if self.group_rm:
            scored, values = group, await self._group_rewards(group)
        else:
            scored = [s for s in group if s.reward is None]
            values = list(await asyncio.gather(*(self._reward(s) for s in scored)))
        for sample, value in zip(scored, values):
            sample.reward = value

    async def _group_rewards(self, group: list[Sample]) -> list[Any]:
        """--group-rm: slime's batched contract, the custom RM gets the whole group and returns a
        list; built-in types score each sample."""
        if not self.custom_rm:
            return list(await asyncio.gather(*(self._reward(s) for s in group)))
        with trace.span(group, "reward", group_rm=True):
            values = self.custom_rm(self.plugin_args, group)
            values = await values if inspect.isawaitable(values) else values
        if not isinstance(values, (list, tuple)) or len(values) != len(group):
            raise RolloutError(f"--custom-rm-path {self.custom_rm_path} with --group-rm must return one reward "
                               f"per sample of the group (a list of {len(group)}), got {values!r:.200}")
        return list(values)

    async def _reward(self, sample: Sample) -> Any:
        with trace.span(sample, "reward"):
            return await self._score(sample)

    async def _score(self, sample: Sample) -> Any:
        if self.custom_rm:
            value = self.custom_rm(self.plugin_args, sample)
            return await value if inspect.isawaitable(value) else value
        if rewards.sample_type(self.rm_type, sample.metadata).removeprefix("boxed_") == rewards.REMOTE:
            if self.remote_rm is None:
                raise RolloutError(f"sample {sample.index}: rm_type remote_rm needs --rm-url (the reward server)")
            return await self.remote_rm.reward(sample)
        # In a thread: sympy's grading can take a while, and requests keep flowing meanwhile.
        return await asyncio.to_thread(rewards.rule_based_reward, self.rm_type, sample.response, sample.label,
                                       sample.metadata)
