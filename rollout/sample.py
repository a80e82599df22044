"""One generated sample: what the rollout produces and the trainer consumes."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any, ClassVar


class Status(str, Enum):
    PENDING = "pending"
    COMPLETED = "completed"
    TRUNCATED = "truncated"  # stopped by max_new_tokens
    ABORTED = "aborted"  # stopped by the engine (pause with abort, weight update, shutdown)


@dataclass
class Sample:
    """A prompt and one response to it. `index` is unique within a rollout; `group_index` ties the
    samples of one prompt together (GRPO-style advantages and pass@k are computed per group; a
    rollout function may return groups of any size). `weight_version` is the version of the
    weights that generated the response (None: the initial checkpoint, or an engine that names
    none)."""

    index: int
    group_index: int
    prompt: str | list[dict[str, str]]
    tokens: list[int] = field(default_factory=list)  # prompt tokens, then response tokens
    response: str = ""
    response_length: int = 0
    label: Any = None
    reward: float | dict[str, Any] | None = None  # a dict when the reward model returns several values
    loss_mask: list[int] = field(default_factory=list)  # one per response token
    status: Status = Status.PENDING
    rollout_log_probs: list[float] = field(default_factory=list)
    weight_version: int | None = None
    # The oldest version that generated any of its response tokens: a sample continued across a weight
    # update (a pause that keeps requests, a partial rollout) has tokens of several. None: not known.
    oldest_weight_version: int | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    spans: list[dict[str, Any]] = field(default_factory=list)  # rollout.trace's record of what happened to it

    Status: ClassVar[type[Status]] = Status  # slime's spelling: Sample.Status.TRUNCATED

    # slime's older plug-ins set these flags instead of `status` (its docs' custom generate
    # example does): each reads and writes the status. A sample told "not truncated" and "not
    # aborted" after its generation is complete.
    @property
    def truncated(self) -> bool:
        return self.status is Status.TRUNCATED

    @truncated.setter
    def truncated(self, value: bool) -> None:
        _set_flag(self, Status.TRUNCATED, value)

    @property
    def aborted(self) -> bool:
        return self.status is Status.ABORTED

    @aborted.setter
    def aborted(self, value: bool) -> None:
        _set_flag(self, Status.ABORTED, value)

    @property
    def generating_version(self) -> int | None:
        """The version its staleness counts from: the oldest that generated it."""
        return self.weight_version if self.oldest_weight_version is None else self.oldest_weight_version

    def reward_value(self, reward_key: str | None) -> float:
        """The number trained on: the reward, or its `reward_key` entry when it is a dict."""
        if isinstance(self.reward, dict):
            if not reward_key:
                raise ValueError(f"sample {self.index}: the reward is a dict (keys {', '.join(map(str, self.reward))}):"
                                 " give --reward-key naming the value to train on")
            if reward_key not in self.reward:
                raise ValueError(f"--reward-key {reward_key}: sample {self.index}'s reward has only the keys "
                                 f"{', '.join(map(str, self.reward))}")
            return float(self.reward[reward_key])
        if reward_key and self.reward is not None:
            raise ValueError(f"--reward-key {reward_key}: sample {self.index}'s reward is {self.reward!r}, not a dict; "
                             "drop --reward-key")
        return float(self.reward or 0.0)

    def get_reward_value(self, args: Any) -> float:
        """slime's spelling (its filters call it): reward_value by args.reward_key."""
        return self.reward_value(getattr(args, "reward_key", None))

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["status"] = self.status.value
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Sample:
        return cls(**{**d, "status": Status(d["status"])})


def _set_flag(sample: Sample, status: Status, value: bool) -> None:
    """A slime flag set (to `status`) or cleared (a pending sample, or one of that status, is then
    complete). Outside the class: there, `Status` names the ClassVar, not the enum."""
    if value:
        sample.status = status
    elif sample.status in (Status.PENDING, status):
        sample.status = Status.COMPLETED


def group_positions(group_index: Iterable[int]) -> list[list[int]]:
    """The positions of each group's samples, given each sample's group_index; groups in the order
    they first appear, of whatever sizes."""
    groups: dict[int, list[int]] = {}
    for position, group in enumerate(group_index):
        groups.setdefault(group, []).append(position)
    return list(groups.values())
