"""One generated sample: what the rollout produces and the trainer consumes (slime's Sample, by
its field names, with what slurmrl adds: weight_version, spans)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, fields
from enum import Enum
from typing import Any, ClassVar


class Status(str, Enum):
    PENDING = "pending"
    COMPLETED = "completed"
    TRUNCATED = "truncated"  # stopped by max_new_tokens
    ABORTED = "aborted"  # stopped by the engine (pause with abort, weight update, shutdown)


_FINISH = {"stop": Status.COMPLETED, "length": Status.TRUNCATED, "abort": Status.ABORTED}  # SGLang's finish_reason


@dataclass
class Sample:
    """A prompt and one response to it. `index` is unique within a rollout; `group_index` ties the
    samples of one prompt together (GRPO-style advantages and pass@k are computed per group; a
    rollout function may return groups of any size). Both are optional, as in slime, for a
    plug-in's new Sample(): the rollout fills them in where a plug-in hands its samples back
    (rollout.generate, rollout.rollout_output). `weight_version` is the version of the weights
    that generated the response (None: the initial checkpoint, or an engine that names none).
    Attributes a plug-in sets beyond the fields (slime's examples do: sample.tool_call_count) go
    along in to_dict/from_dict, as slime's do."""

    index: int | None = None
    group_index: int | None = None
    prompt: str | list[dict[str, str]] = ""
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
    # slime's per-sample plug-ins (an eval set's, --eval-config): they win over the flags'
    custom_rm_path: str | None = None
    generate_function_path: str | None = None

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

    def append_response_tokens(self, args: Any = None, *, tokens: Iterable[int] | None = None,
                               log_probs: Iterable[float] | None = None, trainable: bool = True,
                               meta_info: dict[str, Any] | None = None, text: str | None = None,
                               update_terminal_info: bool = True) -> None:
        """slime's: append response tokens with their loss mask and log-probs kept aligned.
        The model's tokens come with trainable=True and the engine's log-probs (and meta_info);
        a tool's or the environment's with trainable=False, loss mask 0 and log-prob 0. A
        meta_info with a finish_reason sets the status (and the weight version)."""
        new = [int(t) for t in tokens or []]
        logps = None if log_probs is None else [float(x) for x in log_probs]
        if logps is not None and len(logps) != len(new):
            raise ValueError(f"log_probs length {len(logps)} != tokens length {len(new)}")
        if new and trainable and logps is None:
            raise ValueError("trainable response tokens require rollout log probabilities.")
        if new and not trainable:
            if logps is not None:
                raise ValueError("non-trainable response tokens should not pass rollout log probabilities.")
            logps = [0.0] * len(new)
        if text is not None:
            self.response += text
        before = self.response_length
        if new:
            self.tokens += new
            self.response_length += len(new)
            if self.loss_mask is None:  # a plug-in may have cleared it, as slime's None
                self.loss_mask = [1] * before
            self.loss_mask += [1 if trainable else 0] * len(new)  # in place: plug-ins hold the list
        if logps is not None:
            if self.rollout_log_probs is None or (not self.rollout_log_probs and before):
                if trainable and before:
                    raise ValueError("Cannot append trainable rollout log probabilities to a sample with existing "
                                     "response tokens but no existing rollout_log_probs.")
                self.rollout_log_probs = [0.0] * before
            self.rollout_log_probs += logps
        if meta_info is not None and update_terminal_info and "finish_reason" in meta_info:
            if "weight_version" in meta_info:
                from rollout.engine_client import version_from_wire

                self.weight_version = version_from_wire(meta_info["weight_version"])
            finish = (meta_info["finish_reason"] or {}).get("type")
            if finish in _FINISH:
                self.status = _FINISH[finish]
        if len(self.loss_mask or []) != self.response_length:
            raise ValueError(f"loss_mask length {len(self.loss_mask or [])} != response_length {self.response_length}")
        if self.rollout_log_probs and len(self.rollout_log_probs) != self.response_length:
            raise ValueError(f"rollout_log_probs length {len(self.rollout_log_probs)} != response_length "
                             f"{self.response_length}")

    @property
    def effective_response_length(self) -> int:
        """slime's: the response tokens that are trained on."""
        return sum(self.loss_mask) if self.loss_mask is not None else self.response_length

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update({k: v for k, v in vars(self).items() if k not in d})  # a plug-in's own attributes
        d["status"] = self.status.value
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Sample:
        names = {f.name for f in fields(cls)}
        sample = cls(**{k: v for k, v in d.items() if k in names and k != "status"}, status=Status(d["status"]))
        for key, value in d.items():
            if key not in names:
                setattr(sample, key, value)
        return sample


def _set_flag(sample: Sample, status: Status, value: bool) -> None:
    """A slime flag set (to `status`) or cleared (a pending sample, or one of that status, is then
    complete). Outside the class: there, `Status` names the ClassVar, not the enum."""
    if value:
        sample.status = status
    elif sample.status in (Status.PENDING, status):
        sample.status = Status.COMPLETED


def numbered(value: int | None) -> int:
    """A sample's index or group_index where the rollout has set it: the data source numbers its
    samples, rollout.generate and rollout.rollout_output number what plug-ins hand back."""
    if value is None:
        raise ValueError("a sample without an index or group_index reached the rollout; rollout.rollout_output "
                         "numbers what plug-ins return")
    return value


def group_positions(group_index: Iterable[int]) -> list[list[int]]:
    """The positions of each group's samples, given each sample's group_index; groups in the order
    they first appear, of whatever sizes."""
    groups: dict[int, list[int]] = {}
    for position, group in enumerate(group_index):
        groups.setdefault(group, []).append(position)
    return list(groups.values())
