"""Engines as the supervisor sees them, and Engines, the one owner of their records: launched as
steps, waited for until they answer, brought to the current weight version, and only then let
into the router (invariant 1).

Weight versions (ints: the trainer's published version): the trainer publishes version v to every
engine `serving()` lists and reports the result (`published`). An engine is in the router only
while its version is the current one. A replacement engine is synced at once from the newest
published folder when the trainer publishes to disk; with an update group it waits (outside the
router) for the trainer's next publish, which includes it.

One writer: every field of an Engine, the engines being recovered (and those whose recovery waits
for their admission), the engines the kill cap holds back, and the current version are written
here alone, under Engines._lock, and every change of state is a move the table of
supervisor/engine_states.py allows. The engines' records in the state store are written here too:
each operation saves a snapshot of the engines it changed. Router calls are serialized under
Engines._router_lock (taken before _lock, never inside it), so a decision to admit or expel an
engine and the router's membership never disagree for long; HTTP is never done under _lock.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from rollout.engine_client import EngineClient, EngineError
from rollout.router_client import RouterClient, RouterError
from supervisor.engine_marks import EngineMarks, RecoveryStart
from supervisor.engine_record import Engine, copy_into, step_record
from supervisor.engine_start import WrongVersion
from supervisor.engine_states import FAILED, HEALTHY, LIVE, RESTARTING, STARTING, WAITING, EngineState, checked
from supervisor.layout import EnginePlace
from supervisor.state import StateStore, StepRecord

log = logging.getLogger(__name__)

class Engines(Mapping[str, Engine]):
    """The job's engines by name (the set never changes), and every operation that changes one."""

    def __init__(self, places: Iterable[EnginePlace], router: RouterClient, client: EngineClient, api_key: str,
                 listed_timeout_s: float, store: StateStore) -> None:
        """listed_timeout_s: an engine added to the router until the router lists it."""
        self.router = router
        self._client = client
        self._api_key = api_key
        self._listed_timeout_s = listed_timeout_s
        self._store = store
        self._engines = {place.name: Engine(place) for place in places}
        self._lock = threading.Lock()  # every Engine field, _marks and _current
        self._router_lock = threading.Lock()  # router calls, with the decisions they carry out
        self._current: int | None = None  # the newest version the trainer published
        self._marks = EngineMarks()  # recoveries and kill-cap holds

    # ------------------------------------------------------------------ reading
    def __getitem__(self, name: str) -> Engine:
        return self._engines[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._engines)

    def __len__(self) -> int:
        return len(self._engines)

    def by_url(self, url: str) -> Engine | None:
        return next((e for e in self._engines.values() if e.url == url), None)

    @property
    def current(self) -> int | None:
        with self._lock:
            return self._current

    def is_recovering(self, name: str) -> bool:
        with self._lock:
            return name in self._marks.recovering

    def serving(self) -> dict[str, Engine]:
        """Engines that serve, or wait for, the current weights: probed, and given the next version
        (an engine whose recovery waits for its admission among them: the next publish brings it in)."""
        with self._lock:
            return {name: e for name, e in self._engines.items() if e.state in LIVE and self._marks.serving(name)}

    def count(self, state: EngineState) -> int:
        with self._lock:
            return sum(e.state == state for e in self._engines.values())

    def stranded(self) -> list[str]:
        """With no engine serving: those that answer (WAITING) behind the current version, which only
        the trainer's next publish brings them when it is not on disk (an update group's)."""
        with self._lock:
            if self._current is None or any(e.state == HEALTHY for e in self._engines.values()):
                return []
            return [name for name, e in self._engines.items() if e.state == WAITING and e.version != self._current]

    def served_version(self, engine: Engine) -> int | None:
        """The version the engine itself reports; None when it does not answer."""
        try:
            return self._client.weight_version(engine.url)
        except EngineError:
            return None

    # ------------------------------------------------------------------ recovery
    def start_recovering(self, engine: Engine, reason: str) -> RecoveryStart:
        """Mark it recovering (RESTARTING) and take it out of the router: STARTED, and the caller runs
        its recovery. An engine has one recovery at a time: REFUSED, and nothing changes, while it
        is being recovered or once it was given up; but a failure seen while its recovery waits for
        its admission (a publish that dropped it, failed probes) is that recovery's: RETRY, and the
        recovery launches it again."""
        with self._lock:
            started = self._marks.start(engine.name, reason) if engine.state != FAILED else RecoveryStart.REFUSED
            if started is RecoveryStart.REFUSED:
                return started
            self._move(engine, RESTARTING)
        self.expel(engine)
        self._save([engine], last_failure=reason)
        return started

    def await_admission(self, engine: Engine) -> None:
        """Its recovery brought it up and waits for the router: among the serving engines from now
        on (the trainer's next publish includes it), still owned by that recovery."""
        with self._lock:
            if engine.name in self._marks.recovering and engine.state in LIVE:
                self._marks.admitting.add(engine.name)

    def take_retry(self, engine: Engine) -> str | None:
        """Why its recovery must try again (a failure came while it waited for admission), if so."""
        with self._lock:
            return self._marks.retry.pop(engine.name, None)

    def end_recovery(self, engine: Engine) -> str | None:
        """Its recovery is over, unless a failure came at the last moment: then that failure's
        reason, and the recovery goes on (a new one could not start meanwhile: no overlap)."""
        with self._lock:
            retry = self._marks.end(engine.name)
        if retry is None:
            self._save([engine])
        return retry

    def abandon_recovery(self, engine: Engine) -> None:
        """Its recovery stopped short (given up, the job ends, a newer run took over): unmarked."""
        with self._lock:
            self._marks.abandon(engine.name)
        self._save([engine])

    def hold_back(self, engine: Engine, reason: str) -> bool:
        """It failed its probes and the kill cap keeps it running (its record says unhealthy); True
        the first time, False while it is held already (or is no longer live, or recovered)."""
        with self._lock:
            if engine.state not in LIVE or not self._marks.hold(engine.name, reason):
                return False
        self._save([engine], last_failure=f"held back by the kill cap: {reason}")
        return True

    def release_holds(self, answered: Iterable[str]) -> list[Engine]:
        """Engines held back whose probe passed again: no longer held. Returns them."""
        with self._lock:
            released = [self._engines[name] for name in answered if self._marks.held.pop(name, None) is not None]
        self._save(released)
        return released

    def forget_old_crashes(self, engine: Engine, crash_window: float) -> None:
        """A failure long after its last restart starts a new crash loop."""
        with self._lock:
            if time.time() - engine.last_restart > crash_window:
                engine.recent_restarts = 0

    def count_restart(self, engine: Engine) -> None:
        """It is launched again: one more restart, in the job's life and in its crash loop."""
        with self._lock:
            engine.restarts += 1
            engine.recent_restarts += 1
            engine.last_restart = time.time()
        self._save([engine])

    def uncount_crash(self, engine: Engine) -> None:
        """Its relaunch failed while SLURM did not answer, or refused it (rate limit): not its failure."""
        with self._lock:
            engine.recent_restarts -= 1

    def move(self, engine: Engine, place: EnginePlace) -> None:
        """To other nodes (its own were lost): a fresh start there, not part of a crash loop."""
        self.expel(engine)  # under its old url, if it is still listed
        with self._lock:
            engine.place = place
            engine.recent_restarts = 0
        self._save([engine])

    def give_up(self, engine: Engine, reason: str | None = None) -> bool:
        """No more restarts (FAILED), unless it was given up already (then False); reason: the
        failure to record, if it is news."""
        with self._lock:
            if engine.state == FAILED:
                return False
            self._move(engine, FAILED)
            self._marks.held.pop(engine.name, None)
        self._save([engine], last_failure=reason)
        return True

    # ------------------------------------------------------------------ starting and versions
    def launched(self, engine: Engine) -> None:
        """Its step was (re)launched: STARTING, at no known version, outside the router."""
        self.expel(engine)
        with self._lock:
            self._move(engine, STARTING)
            engine.version = None
        self._save([engine])

    def answered(self, engine: Engine, adopted: bool) -> bool:
        """It answers /health_generate: WAITING until it serves the current version. Whether to
        sync it from disk now: not an adopted engine off the current version (it took a publish
        during the gap, its report is on the way, or it was being synced: a sync could take it a
        version back; the trainer's report or next publish brings it in). Nor one a recovery took
        over meanwhile (the first start's wait can answer just before its step is stopped)."""
        with self._lock:  # a publish meanwhile finds it waiting, or has made its version current
            if engine.state == RESTARTING:
                return False
            self._move(engine, WAITING)
            off_version = adopted and engine.version != self._current
        self._save([engine])
        return not off_version

    def loaded(self, engine: Engine, folder: Path, version: int, timeout_s: float) -> None:
        """Load a published folder into the engine (timeout_s bounds it); it serves `version` then,
        as it says itself: WrongVersion if it reports an older one, or none (a newer one is a
        publish of the trainer's that came meanwhile)."""
        self._client.load_from_disk(engine.url, folder, version, timeout_s=timeout_s)
        reported = self._client.weight_version(engine.url)
        with self._lock:
            engine.version = reported
        self._save([engine])
        if reported is None or reported < version:
            raise WrongVersion(engine.name, version, reported)

    @contextmanager
    def syncing(self, engine: Engine) -> Iterator[bool]:
        """Around the supervisor's loads of the current version into the engine from disk: it is left
        out of the trainer's publishes meanwhile (serving), whose update could land before the load and
        be undone by it (the engine then reports the older version and fails the publish). Yields
        False, marking nothing, while another sync of the engine is under way: that one loads the
        newer version."""
        with self._lock:
            first = engine.name not in self._marks.syncing
            self._marks.syncing.add(engine.name)
        try:
            yield first
        finally:
            if first:
                with self._lock:
                    self._marks.syncing.discard(engine.name)

    def admit(self, engine: Engine) -> bool:
        """Into the router if (and only if) it is live and itself reports the current version."""
        with self._router_lock:
            admitted = self._admit(engine)
        self._save([engine])
        return admitted

    def expel(self, engine: Engine) -> None:
        with self._router_lock:
            self._expel(engine)

    def published(self, version: int, updated: set[str]) -> list[Engine]:
        """After the trainer published `version` (to the engines at `updated`): admit the live
        engines that took it; live engines still on an older version leave the router and wait.
        Returns the engines left behind."""
        with self._router_lock:
            with self._lock:
                self._current = version
                took, behind = [], []
                for engine in self._engines.values():
                    if engine.url in updated:
                        engine.version = version
                        took += [engine] if engine.state in LIVE else []
                    elif engine.state in LIVE:
                        self._move(engine, WAITING)
                        behind.append(engine)
            for engine in behind:
                self._expel(engine)
            for engine in took:
                self._admit(engine)
        self._save(self._engines.values())
        return behind

    def rejoin_router(self) -> None:
        """A new router knows no one: register every healthy engine again."""
        with self._router_lock:
            with self._lock:
                for engine in self._engines.values():
                    engine.in_router = False
                healthy = [e for e in self._engines.values() if e.state == HEALTHY]
            for engine in healthy:
                self._admit(engine)
        self._save(self._engines.values())

    def restore(self, current: int | None, restarts: Mapping[str, int], listed: set[str],
                served: Mapping[str, int | None]) -> None:
        """A crashed predecessor's engines taken over: its current version and restart counts; the
        adopted engines (`served`: the version each reports) stay in the router only if they
        serve the current version and the router lists them (`listed`: urls); any other leaves it."""
        with self._router_lock:
            with self._lock:
                self._current = current
                stale = []
                for engine in self._engines.values():
                    engine.restarts = restarts.get(engine.name, 0)
                    engine.in_router = engine.url in listed
                    if engine.name in served:
                        engine.version = served[engine.name]
                    if engine.name in served and engine.in_router and engine.version == current:
                        self._move(engine, HEALTHY)
                    else:
                        stale.append(engine)
            for engine in stale:
                self._expel(engine)
        self._save(self._engines.values())

    # ------------------------------------------------------------------ the state store
    def record_start(self) -> None:
        """The job's start: a fresh record of every engine in the state store."""
        with self._store.update() as state, self._lock:
            for engine in self._engines.values():
                place = engine.place
                state.steps[engine.name] = StepRecord(engine.name, "engine", place.het_group, list(place.nodes))
                copy_into(state.steps[engine.name], engine, held=False)

    def record_stopped(self, name: str) -> None:
        """The supervisor stopped its step: `failed` if it was given up, else `stopped`."""
        with self._lock:
            failed = self._engines[name].state == FAILED
        self._store.update_step(name, state=FAILED.value if failed else "stopped")

    def _save(self, engines: Iterable[Engine], last_failure: str | None = None) -> None:
        """The engines' records in the state store, as they are now (read under the store's lock
        and then ours: a later save never writes an older snapshot)."""
        with self._store.update() as state, self._lock:
            state.weight_version = self._current
            for engine in engines:
                copy_into(step_record(state, engine), engine, held=engine.name in self._marks.held)
                if last_failure is not None:
                    state.steps[engine.name].last_failure = last_failure

    # ------------------------------------------------------------------ under the locks
    def _move(self, engine: Engine, new: EngineState) -> None:
        """(holding _lock)"""
        engine.state = checked(engine.name, engine.state, new)

    def _admit(self, engine: Engine) -> bool:
        """(holding _router_lock)"""
        with self._lock:
            current, listed = self._current, engine.in_router
            if current is None or engine.version != current or engine.state not in LIVE:
                return False
        reported = self._client.weight_version(engine.url)
        if reported != current:
            with self._lock:
                engine.version = reported
            return False
        if not listed:
            self.router.add_worker(engine.url, api_key=self._api_key, worker_type=engine.place.role,
                                   bootstrap_port=engine.place.bootstrap_port)
            self.router.wait_listed(engine.url, timeout_s=self._listed_timeout_s)
        with self._lock:
            engine.in_router = True
            if engine.state not in LIVE:  # a recovery took it out meanwhile: its expel (next) removes it
                return False
            self._move(engine, HEALTHY)
            return True

    def _expel(self, engine: Engine) -> None:
        """(holding _router_lock)"""
        if not engine.in_router:
            return
        try:
            self.router.remove_worker(engine.url)
        except RouterError as err:  # a dead router forgets its workers anyway
            log.warning("could not remove %s from the router: %s", engine.url, err)
        with self._lock:
            engine.in_router = False
