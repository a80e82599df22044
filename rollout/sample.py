"""One generated sample: what the rollout produces and the trainer consumes."""

from __future__ import annotations

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
    n samples of one prompt together (GRPO-style advantages are computed per group)."""

    index: int
    group_index: int
    prompt: str | list[dict[str, str]]
    tokens: list[int] = field(default_factory=list)  # prompt tokens, then response tokens
    response: str = ""
    response_length: int = 0
    label: Any = None
    reward: float | None = None
    loss_mask: list[int] = field(default_factory=list)  # one per response token
    status: Status = Status.PENDING
    rollout_log_probs: list[float] = field(default_factory=list)
    weight_version: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)

    Status: ClassVar[type[Status]] = Status  # slime's spelling: Sample.Status.TRUNCATED

    # slime's older plug-ins set these flags instead of `status` (its docs' custom generate
    # example does): each reads and writes the status. A sample told "not truncated" and "not
    # aborted" after its generation is complete.
    @property
    def truncated(self) -> bool:
        return self.status is Status.TRUNCATED

    @truncated.setter
    def truncated(self, value: bool) -> None:
        self._set_flag(Status.TRUNCATED, value)

    @property
    def aborted(self) -> bool:
        return self.status is Status.ABORTED

    @aborted.setter
    def aborted(self, value: bool) -> None:
        self._set_flag(Status.ABORTED, value)

    def _set_flag(self, status: Status, value: bool) -> None:
        if value:
            self.status = status
        elif self.status in (Status.PENDING, status):
            self.status = Status.COMPLETED

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["status"] = self.status.value
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Sample:
        return cls(**{**d, "status": Status(d["status"])})
