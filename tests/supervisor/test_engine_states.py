"""The engine state machine: the table of allowed moves, its owner (Engines) as the one writer of
every engine field and of the engines' records in the state store, and its atomic operations."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from contract.job_dir import JobDir
from supervisor.engine_marks import RecoveryStart
from supervisor.engine_record import Engine
from supervisor.engine_states import (
    FAILED,
    HEALTHY,
    RESTARTING,
    STARTING,
    TRANSITIONS,
    WAITING,
    EngineState,
    IllegalTransition,
    checked,
)
from supervisor.engines import Engines
from supervisor.layout import EnginePlace
from supervisor.state import StateStore

SUPERVISOR = Path(__file__).resolve().parents[2] / "supervisor"
OWNER = "engines.py"
ENGINE_FIELDS = {"state", "version", "in_router", "restarts", "recent_restarts", "last_restart", "place"}


ALLOWED = {  # written out again: a change of the table is a change of this test too
    (STARTING, STARTING), (STARTING, WAITING), (STARTING, HEALTHY), (STARTING, RESTARTING), (STARTING, FAILED),
    (WAITING, STARTING), (WAITING, WAITING), (WAITING, HEALTHY), (WAITING, RESTARTING), (WAITING, FAILED),
    (HEALTHY, WAITING), (HEALTHY, HEALTHY), (HEALTHY, RESTARTING), (HEALTHY, FAILED),
    (RESTARTING, STARTING), (RESTARTING, RESTARTING), (RESTARTING, FAILED),
}


def test_every_allowed_transition_is_allowed() -> None:
    assert {(old, new) for old, targets in TRANSITIONS.items() for new in targets} == ALLOWED
    for old, new in ALLOWED:
        assert checked("engine-0", old, new) is new


def test_every_other_transition_is_refused_naming_both_states() -> None:
    refused = [(old, new) for old in EngineState for new in EngineState if new not in TRANSITIONS[old]]
    assert (FAILED, STARTING) in refused and (HEALTHY, STARTING) in refused and (RESTARTING, HEALTHY) in refused
    for old, new in refused:
        with pytest.raises(IllegalTransition, match=f"engine-3: {old.value} -> {new.value} "):
            checked("engine-3", old, new)


def test_failed_is_the_end_and_every_state_can_fail() -> None:
    assert TRANSITIONS[FAILED] == frozenset()
    assert all(FAILED in TRANSITIONS[state] for state in EngineState if state is not FAILED)


def _engine_field_writes(path: Path) -> list[str]:
    """Assignments (plain, augmented, setattr) to an engine's fields in one module."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = [t for target in node.targets for t in (target.elts if isinstance(target, ast.Tuple) else [target])]
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr"
              and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and node.args[1].value in ENGINE_FIELDS):
            found.append(f"{path.name}:{node.lineno} setattr({ast.unparse(node.args[0])}, {node.args[1].value!r})")
        for target in targets:
            if (isinstance(target, ast.Attribute) and target.attr in ENGINE_FIELDS
                    and "engine" in ast.unparse(target.value).lower()):
                found.append(f"{path.name}:{getattr(node, 'lineno', 0)} {ast.unparse(target)}")
    return found


def test_only_the_owner_writes_an_engines_fields() -> None:
    modules = sorted(SUPERVISOR.glob("*.py"))
    assert any(m.name == OWNER for m in modules)
    writes = [w for m in modules if m.name != OWNER for w in _engine_field_writes(m)]
    assert writes == [], f"engine fields written outside supervisor/{OWNER}: {writes}"
    assert _engine_field_writes(SUPERVISOR / OWNER), "the scan finds no write even in the owner"


class _Router:
    def __init__(self) -> None:
        self.workers: list[str] = []

    def add_worker(self, url: str, **kwargs: object) -> None:
        self.workers.append(url)

    def wait_listed(self, url: str, timeout_s: float) -> None:
        assert url in self.workers

    def remove_worker(self, url: str) -> bool:
        self.workers.remove(url)
        return True


class _Client:
    """Each engine reports the version `served` names (None: the initial checkpoint), as
    EngineClient.weight_version parses it from the wire."""

    def __init__(self) -> None:
        self.served: dict[str, int | None] = {}

    def weight_version(self, url: str) -> int | None:
        return self.served.get(url)


def _engines(tmp_path: Path, n: int = 2) -> tuple[Engines, _Router, _Client, StateStore]:
    places = [EnginePlace(f"engine-{k}", k, ("n1",), "127.0.0.1", 20010 + k, 1, 0) for k in range(n)]
    router, client, store = _Router(), _Client(), StateStore(JobDir(tmp_path))
    engines = Engines(places, router, client, "key", listed_timeout_s=1.0, store=store)
    engines.record_start()
    return engines, router, client, store


def _answering(engines: Engines, engine: Engine) -> None:
    engines.launched(engine)
    engines.answered(engine, adopted=False)


def test_a_publish_admits_the_engines_that_took_it_and_records_them(tmp_path: Path) -> None:
    engines, router, client, store = _engines(tmp_path)
    e0, e1 = engines["engine-0"], engines["engine-1"]
    for engine in (e0, e1):
        _answering(engines, engine)
    client.served = {e0.url: 3, e1.url: 2}  # engine-1 missed the update
    behind = engines.published(3, {e0.url})
    assert behind == [e1] and e0.state == HEALTHY and e0.in_router and e0.version == 3
    assert e1.state == WAITING and not e1.in_router and router.workers == [e0.url]
    saved = store.snapshot()
    assert saved.weight_version == 3 and saved.steps["engine-0"].state == "healthy"
    assert saved.steps["engine-0"].weight_version == 3 and saved.steps["engine-1"].state == "waiting"


def test_recovery_is_started_once_and_takes_the_engine_out(tmp_path: Path) -> None:
    engines, router, client, store = _engines(tmp_path)
    e0 = engines["engine-0"]
    _answering(engines, e0)
    client.served = {e0.url: 1}
    engines.published(1, {e0.url})
    assert engines.start_recovering(e0, "exited with code 1") is RecoveryStart.STARTED
    assert engines.start_recovering(e0, "the same failure, seen again") is RecoveryStart.REFUSED
    assert e0.state == RESTARTING and not e0.in_router and router.workers == [] and engines.is_recovering(e0.name)
    assert "engine-0" not in engines.serving()
    assert store.snapshot().steps["engine-0"].last_failure == "exited with code 1"
    assert engines.give_up(e0) is True and engines.give_up(e0) is False  # once
    engines.abandon_recovery(e0)
    assert engines.start_recovering(e0, "after it was given up") is RecoveryStart.REFUSED
    with pytest.raises(IllegalTransition, match="failed -> starting"):
        engines.launched(e0)


def test_an_engine_taken_out_meanwhile_is_not_admitted(tmp_path: Path) -> None:
    engines, router, client, _ = _engines(tmp_path, n=1)
    e0 = engines["engine-0"]
    _answering(engines, e0)
    client.served = {e0.url: 4}
    engines.published(4, set())  # the engine was not updated: it waits
    engines.start_recovering(e0, "probe failed")
    assert engines.admit(e0) is False and e0.state == RESTARTING and router.workers == []


def test_a_first_start_wait_answering_after_a_recovery_took_the_engine_leaves_it_to_the_recovery(
        tmp_path: Path) -> None:
    engines, _, _, _ = _engines(tmp_path, n=1)
    e0 = engines["engine-0"]
    engines.start_recovering(e0, "restart asked with slurmrl restart")
    assert engines.answered(e0, adopted=False) is False and e0.state == RESTARTING


def test_an_engine_reporting_another_version_stays_out(tmp_path: Path) -> None:
    engines, router, client, _ = _engines(tmp_path, n=1)
    e0 = engines["engine-0"]
    _answering(engines, e0)
    client.served = {e0.url: 4}
    engines.published(5, {e0.url})  # reported updated, but it serves 4
    assert e0.version == 4 and e0.state == WAITING and router.workers == []


def test_a_failure_while_its_recovery_awaits_admission_is_that_recoverys_retry(tmp_path: Path) -> None:
    engines, router, client, _ = _engines(tmp_path, n=1)
    e0 = engines["engine-0"]
    assert engines.start_recovering(e0, "exited with code 1") is RecoveryStart.STARTED
    assert "engine-0" not in engines.serving()
    _answering(engines, e0)  # relaunched by its recovery; the current version is not on disk
    engines.await_admission(e0)
    assert "engine-0" in engines.serving(), "the next publish must include it"
    assert engines.start_recovering(e0, "dropped by the publish") is RecoveryStart.RETRY
    assert e0.state == RESTARTING and "engine-0" not in engines.serving() and engines.is_recovering("engine-0")
    assert engines.start_recovering(e0, "its step exited, as it was stopped") is RecoveryStart.REFUSED
    assert engines.take_retry(e0) == "dropped by the publish" and engines.take_retry(e0) is None
    _answering(engines, e0)  # the next try
    engines.await_admission(e0)
    assert engines.start_recovering(e0, "probe failed") is RecoveryStart.RETRY
    assert engines.end_recovery(e0) == "probe failed" and engines.is_recovering("engine-0"), "it goes on"
    _answering(engines, e0)
    client.served = {e0.url: 2}
    engines.published(2, {e0.url})  # an admission of its own: not yet the recovery's end
    assert e0.state == HEALTHY and e0.in_router and engines.is_recovering("engine-0")
    assert engines.end_recovery(e0) is None and not engines.is_recovering("engine-0")
    assert engines.start_recovering(e0, "a later failure") is RecoveryStart.STARTED


def test_only_its_recovery_unmarks_an_engine(tmp_path: Path) -> None:
    engines, _, _, _ = _engines(tmp_path, n=1)
    e0 = engines["engine-0"]
    assert engines.start_recovering(e0, "exited") is RecoveryStart.STARTED
    engines.await_admission(e0)  # not live yet: no admission wait
    assert engines.start_recovering(e0, "again") is RecoveryStart.REFUSED
    engines.abandon_recovery(e0)
    assert not engines.is_recovering("engine-0") and engines.take_retry(e0) is None
