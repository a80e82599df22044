"""Rank 0's view of the engines: which serve now, and taking out one that failed.

Supervised, the supervisor knows the ready engines and replaces a failed one; unsupervised the
router's workers are the engines and a failed one leaves the router; --engine-urls fixes the list.
"""

from __future__ import annotations

import logging

from rollout.router_client import RouterClient
from trainer.supervisor_link import SupervisorLink

log = logging.getLogger(__name__)


class EngineFleet:
    def __init__(self, engine_urls: list[str] | None, supervisor: SupervisorLink | None,
                 router: RouterClient | None) -> None:
        self.engine_urls = engine_urls
        self.supervisor = supervisor
        self.router = router

    def engines(self) -> list[str]:
        if self.engine_urls:
            return list(self.engine_urls)
        if self.supervisor:
            return self.supervisor.ready_engines()
        return sorted(self.router.workers()) if self.router else []

    def launches(self) -> dict[str, int]:
        """url -> how often the supervisor launched it again, for the engines engines() last named
        (empty unsupervised: an engine's process is then not known to change under its url)."""
        return dict(self.supervisor.launches) if self.supervisor else {}

    def drop(self, url: str, reason: str) -> None:
        """An engine that failed a request or an update stops getting work: the supervisor takes
        it out and brings it back at the current version; without one it leaves the router."""
        log.warning("dropping engine %s: %s", url, reason)
        if self.supervisor:
            self.supervisor.engine_failed(url, reason)
        elif self.router:
            self.router.remove_worker(url)

    def unresponsive(self, url: str, reason: str) -> None:
        """An engine that holds requests past their deadline or answers what does not parse, while
        its probes may pass: the supervisor replaces it; without one it leaves the router."""
        log.warning("engine %s does not answer requests: %s", url, reason)
        if self.supervisor:
            self.supervisor.engine_unresponsive(url, reason)
        elif self.router:
            self.router.remove_worker(url)
