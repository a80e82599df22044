"""Users' functions failing on single samples (a --custom-rm-path that raises for 1 sample in 50, a
--custom-generate-function-path that leaves a sample unfinished): the rollout goes on.

Each error is logged and counted (the rollout's `sample_errors` metric); the first of each function
in the trainer's life is reported with its exception (the trainer tells the supervisor: a
`plugin_error` event). The sample then gets what --sample-error-policy says:
- zero_reward (the default): it stays in its group with reward 0, as slime's own agent examples
  score a sample their tools failed on;
- drop_group: its group is dropped, and the round takes another group from the prompts.
A sample whose generation (or a --rollout-sample-hook-path hook) failed has no response to train
on: its group is dropped under either policy. A round stops where another batch of prompts would
fail the same way (generate.py): when every finished sample failed, or every finished group was
dropped for its samples' errors (a function failing everywhere is a bug, or its service is down).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from rollout.errors import RolloutError
from rollout.plugins import PluginError, described, repeats
from rollout.sample import Sample, numbered

log = logging.getLogger(__name__)

ZERO_REWARD, DROP_GROUP = "zero_reward", "drop_group"
POLICIES = (ZERO_REWARD, DROP_GROUP)
ERROR_KEY = "sample_error"  # in a zero-reward sample's metadata: what failed on it
METRIC = "sample_errors"  # a rollout's count, in metrics.jsonl

# Told the function (flag and path), the exception in one line, the sample's index.
FirstErrorHandler = Callable[[str, str, int], None]


@dataclass(frozen=True)
class SampleError:
    plugin: str  # the flag and the function's path: "--custom-rm-path my_pkg.rm.score"
    error: str  # the exception in one line
    sample: int  # the sample's index
    repeats: bool  # a restart would meet it again (plugins.repeats)


@dataclass
class SampleErrors:
    """The errors of the trainer's life (one object, kept across rounds like DecodeSpeed)."""

    policy: str = ZERO_REWARD
    on_first: FirstErrorHandler | None = field(default=None, repr=False)
    total: int = 0  # errors so far: a rollout's count is the difference across it
    _reported: set[str] = field(default_factory=set, repr=False)

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"--sample-error-policy {self.policy!r}: one of {', '.join(POLICIES)}")

    def record(self, flag: str, path: str, sample: Sample, err: Exception) -> SampleError:
        plugin, text = f"{flag} {path}", described(err)
        self.total += 1
        if plugin in self._reported:
            log.warning("%s failed on sample %d: %s", plugin, sample.index, text)
        else:
            self._reported.add(plugin)
            log.error("%s failed on sample %d (first error of this function; later ones are counted in the "
                      "sample_errors metric)", plugin, sample.index, exc_info=err)
            if self.on_first is not None:
                self.on_first(plugin, text, numbered(sample.index))
        return SampleError(plugin, text, numbered(sample.index), repeats(err))

    def zero_reward(self, sample: Sample, error: SampleError, reward_key: str | None) -> None:
        """zero_reward's verdict: reward 0 (under --reward-key's name for dict rewards)."""
        sample.reward = {reward_key: 0.0} if reward_key else 0.0
        sample.metadata[ERROR_KEY] = f"{error.plugin}: {error.error}"

    @property
    def drops_groups(self) -> bool:
        return self.policy == DROP_GROUP


def nothing_trainable(errors: list[SampleError], samples: int, dropped_groups: int, rollout_id: int) -> RolloutError:
    """What stops a round whose `samples` finished samples all failed, or whose `dropped_groups`
    finished groups were all dropped for errors: a PluginError naming the first function and its
    exception when a restart would meet it again, else a RolloutError (the trainer's restarts are
    for those: a reward server that is down, say)."""
    first = errors[0]
    flag, _, path = first.plugin.partition(" ")
    what = (f"every one of the {samples} finished samples of rollout {rollout_id} failed in user code"
            if len(errors) >= samples else
            f"no group of rollout {rollout_id} can be trained on: each of the {dropped_groups} finished groups had "
            f"a sample that failed in user code ({len(errors)} of {samples} samples)")
    message = f"{what}; the first: {first.plugin} on sample {first.sample}: {first.error}"
    if any(e.repeats for e in errors):
        return PluginError(message, flag, path)
    return RolloutError(message)
