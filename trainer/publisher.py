"""The loop's publisher: the trainer's weights to every ready engine as a version, the supervisor
told which engines took it. Rank 0 sends (trainer.publish.WeightPublisher, the transport); every
other rank only takes part in gathering the weights.

The supervisor is told (report) once the loop has handed the engines back all their memory
(colocated): it admits an engine that took the version into the router, whose health check is a
generation, which an engine without its KV cache cannot run."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from contract.job_dir import Metric, Phase
from trainer.publish import WeightPublisher
from trainer.rollout_source import Heartbeat
from trainer.supervisor_link import SupervisorLink

Weights = Iterator[tuple[str, torch.Tensor]]


class Publisher:
    def __init__(self, transport: WeightPublisher | None, engines: Callable[[], list[str]],
                 supervisor: SupervisorLink | None, heartbeat: Heartbeat) -> None:
        """transport: rank 0's, None on other ranks and with --debug-train-only (nothing is sent)."""
        self.transport = transport
        self.engines = engines
        self.supervisor = supervisor
        self.heartbeat = heartbeat
        self._unreported: tuple[int, list[str], dict[str, str]] | None = None  # rank 0's last publish

    def publish(self, version: int, rollout_id: int, weights: Weights) -> dict[str, Any]:
        """Send `weights` as `version` (collective: every rank draws `weights`); rollout_id is the
        next rollout, for the heartbeat. Returns the publish's metrics (rank 0; {} elsewhere)."""
        if self.transport is None:
            for _ in weights:  # collective: the other ranks take part in the gathers
                pass
            return {}
        self.heartbeat(Phase.PUBLISH, rollout_id)
        result = self.transport.publish(version, self.engines(), weights)
        self._unreported = (version, result.updated, result.dropped)
        return {Metric.PUBLISH_SECONDS: result.seconds, Metric.PUBLISH_BYTES: result.bytes,
                "engines_updated": len(result.updated),
                "engines_dropped": len(result.dropped)}

    def report(self) -> None:
        """Tell the supervisor which engines took the last version (rank 0; nothing elsewhere)."""
        unreported, self._unreported = self._unreported, None
        if unreported and self.supervisor:
            self.supervisor.published(*unreported)
