"""The trainer's side of the supervisor's control socket (rank 0 only).

The supervisor owns the engines: it says which are ready (at the current weight version, or
waiting for it), hears which failed, learns each published version, and can ask the trainer
to save and stop between rollouts (`slurmrl stop`, preemption).

A supervisor that crashes is restarted by its watchdog (supervisor.watchdog) and adopts the
trainer; the calls the trainer cannot go on without wait out that gap (up to gap_s) instead of
ending the training.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from supervisor.control import ControlClient, ControlError, SupervisorUnreachable

log = logging.getLogger(__name__)

GAP_S = 120.0  # a restart takes seconds; a supervisor gone this long is not coming back


class SupervisorLink:
    def __init__(self, job_dir: Path, gap_s: float = GAP_S, retry_s: float = 1.0) -> None:
        self.client = ControlClient(job_dir)
        self.gap_s = gap_s
        self.retry_s = retry_s

    def ready_engines(self) -> list[str]:
        """Engines that should get the next weight version."""
        return list(self._call("ready_engines")["engines"])

    def engine_failed(self, url: str, reason: str) -> None:
        # Not waited for (the rollout goes on meanwhile): a restarted supervisor probes the engine itself.
        self._tell(self.client.call, "engine_failed", url=url, reason=reason)

    def published(self, version: int, updated: list[str], fenced: dict[str, str]) -> None:
        # Waited for: a restarted supervisor must learn the version the engines now serve.
        self._tell(self._call, "published", version=version, updated=updated, fenced=fenced)

    def stop_requested(self, rollout_id: int) -> bool:
        """Between rollouts: should the trainer save now and end? (Also the trainer's liveness.)"""
        return bool(self._call("trainer_poll", rollout_id=rollout_id).get("stop"))

    def _call(self, name: str, **args: object) -> dict[str, Any]:
        """The call, asked again while no supervisor answers, for up to gap_s."""
        deadline = time.monotonic() + self.gap_s
        warned = False
        while True:
            try:
                return self.client.call(name, **args)
            except SupervisorUnreachable as err:
                if time.monotonic() + self.retry_s > deadline:
                    raise
                if not warned:
                    log.warning("%s; asking %s again for up to %.0f s", err, name, self.gap_s)
                    warned = True
                time.sleep(self.retry_s)

    def _tell(self, call: Callable[..., dict[str, Any]], name: str, **args: object) -> None:
        # A report that does not arrive must not stop training: the supervisor re-checks engines itself.
        try:
            call(name, **args)
        except ControlError as err:
            log.warning("could not tell the supervisor %s: %s", name, err)
