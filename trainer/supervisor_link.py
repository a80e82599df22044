"""The trainer's side of the supervisor's control socket (rank 0 only).

The supervisor owns the engines: it says which are ready (at the current weight version, or
waiting for it), hears which failed, learns each published version, and can ask the trainer
to save and stop between rollouts (`slurmrl stop`, preemption).
"""

from __future__ import annotations

import logging
from pathlib import Path

from supervisor.control import ControlClient, ControlError

log = logging.getLogger(__name__)


class SupervisorLink:
    def __init__(self, job_dir: Path) -> None:
        self.client = ControlClient(job_dir)

    def ready_engines(self) -> list[str]:
        """Engines that should get the next weight version."""
        return list(self.client.call("ready_engines")["engines"])

    def engine_failed(self, url: str, reason: str) -> None:
        self._tell("engine_failed", url=url, reason=reason)

    def published(self, version: int, updated: list[str], fenced: dict[str, str]) -> None:
        self._tell("published", version=version, updated=updated, fenced=fenced)

    def stop_requested(self, rollout_id: int) -> bool:
        """Between rollouts: should the trainer save now and end? (Also the trainer's liveness.)"""
        return bool(self.client.call("trainer_poll", rollout_id=rollout_id).get("stop"))

    def _tell(self, name: str, **args: object) -> None:
        # A report that does not arrive must not stop training: the supervisor re-checks engines itself.
        try:
            self.client.call(name, **args)
        except ControlError as err:
            log.warning("could not tell the supervisor %s: %s", name, err)
