"""Prefill/decode engines as the supervisor sees them: the job cannot go on once every engine of
one role is given up (a PD router needs a prefill and a decode engine for every request)."""

from __future__ import annotations

from supervisor.engine_record import Engine, roles_missing
from supervisor.engine_states import FAILED, HEALTHY
from supervisor.layout import EnginePlace


def _engine(k: int, role: str, state: str = HEALTHY) -> Engine:
    return Engine(EnginePlace(f"engine-{k}", k, ("n1",), "127.0.0.1", 20010 + k, 1, 0, role=role,
                              bootstrap_port=20020 + k if role == "prefill" else None), state=state)


def test_regular_engines_have_no_roles_to_miss() -> None:
    assert roles_missing([_engine(0, "regular", FAILED), _engine(1, "regular")]) == []


def test_a_role_is_missing_once_its_last_engine_is_given_up() -> None:
    engines = [_engine(0, "prefill"), _engine(1, "decode"), _engine(2, "decode", FAILED)]
    assert roles_missing(engines) == []
    engines[0].state = FAILED
    assert roles_missing(engines) == ["prefill"]
    engines[1].state = FAILED
    assert roles_missing(engines) == ["decode", "prefill"]
