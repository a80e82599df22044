"""Engines as the supervisor sees them: launch one as its own step, wait until it answers, bring it
to the current weight version, and only then let the router send it work (invariant 1).

Weight versions: the trainer publishes version v to every engine `ready_engines()` lists and
reports the result (`published`). An engine is in the router only while its version is the
current one. A replacement engine is synced at once from the newest published folder when the
trainer publishes to disk; with an update group it waits (outside the router) for the trainer's
next publish, which includes it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rollout.engine_client import EngineClient
from rollout.router_client import RouterClient, RouterError
from supervisor.layout import EnginePlace

log = logging.getLogger(__name__)

# Engine states (the state store's vocabulary)
STARTING, WAITING, HEALTHY, RESTARTING, FAILED = "starting", "waiting", "healthy", "restarting", "failed"
# Seconds between /health_generate tries while waiting for a starting engine.
HEALTH_POLL_S = 0.5


class EngineStartError(RuntimeError):
    pass


@dataclass
class Engine:
    place: EnginePlace
    state: str = STARTING
    version: str | None = None  # the weight version it serves (None: the initial checkpoint)
    restarts: int = 0  # in the job's life
    recent_restarts: int = 0  # in a row, each soon after the one before: the crash-loop count
    last_restart: float = 0.0
    in_router: bool = False

    @property
    def name(self) -> str:
        return self.place.name

    @property
    def url(self) -> str:
        return self.place.url


class Membership:
    """Which engines the router routes to, kept consistent with the current weight version."""

    def __init__(self, router: RouterClient, client: EngineClient, api_key: str, listed_timeout_s: float) -> None:
        """listed_timeout_s: an engine added to the router until the router lists it."""
        self.router = router
        self.client = client
        self.api_key = api_key
        self.listed_timeout_s = listed_timeout_s
        self.lock = threading.RLock()  # versions and router membership change together
        self.current: str | None = None

    def admit(self, engine: Engine) -> bool:
        """Into the router if (and only if) the engine itself reports the current version."""
        with self.lock:
            if self.current is None or engine.version != self.current:
                return False
            reported = self.client.weight_version(engine.url)
            if reported != self.current:
                engine.version = reported
                return False
            if not engine.in_router:
                self.router.add_worker(engine.url, api_key=self.api_key, worker_type=engine.place.role,
                                       bootstrap_port=engine.place.bootstrap_port)
                self.router.wait_listed(engine.url, timeout_s=self.listed_timeout_s)
                engine.in_router = True
            engine.state = HEALTHY
            return True

    def expel(self, engine: Engine) -> None:
        with self.lock:
            if engine.in_router:
                try:
                    self.router.remove_worker(engine.url)
                except RouterError as err:  # a dead router forgets its workers anyway
                    log.warning("could not remove %s from the router: %s", engine.url, err)
                engine.in_router = False

    def published(self, version: str, engines: list[Engine], updated: set[str]) -> list[Engine]:
        """After the trainer published `version`: admit the engines that took it; engines still
        on an older version leave the router. Returns the engines left behind."""
        with self.lock:
            self.current = version
            behind = []
            for engine in engines:
                if engine.url in updated:
                    engine.version = version
                    if engine.state in (WAITING, HEALTHY):
                        self.admit(engine)
                elif engine.state in (WAITING, HEALTHY):
                    self.expel(engine)
                    engine.state = WAITING
                    behind.append(engine)
            return behind

    def rejoin_router(self, engines: list[Engine]) -> None:
        """A new router knows no one: register every engine at the current version."""
        with self.lock:
            for engine in engines:
                engine.in_router = False
                if engine.state == HEALTHY:
                    self.admit(engine)


def roles_missing(engines: list[Engine]) -> list[str]:
    """With prefill/decode engines: the roles no live engine has left (a PD router needs a prefill
    and a decode engine for every request, so the job cannot go on without one of each)."""
    wanted = {e.place.role for e in engines} - {"regular"}
    return sorted(wanted - {e.place.role for e in engines if e.state != FAILED})


def wait_healthy(client: EngineClient, engine: Engine, deadline_s: float, alive: Callable[[], bool]) -> None:
    """Until the engine answers /health_generate, its step dies, or the deadline passes."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if not alive():
            raise EngineStartError(f"{engine.name} exited while starting (see its log)")
        if client.healthy(engine.url):
            return
        time.sleep(HEALTH_POLL_S)
    raise EngineStartError(f"{engine.name} did not answer /health_generate within {deadline_s:.0f} s")


def newest_weights(weights_dir: Path, version: str | None) -> Path | None:
    """The published folder of `version`, if the trainer published it to disk."""
    if version is None:
        return None
    folder = weights_dir / version
    return folder if folder.is_dir() else None
