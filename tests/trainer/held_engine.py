"""A real CPU engine behind the real router whose decode steps are held (--decode-step-hold-ms), so
that groups are still generating when a test's trainer takes a rollout, publishes or stops: the
module-scoped fixtures of the asynchronous-RL tests, and conditions on what the engine generated."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import requests

from rollout.router_client import RouterClient
from rollout.tiny_model import write_tiny_model
from tests.rollout.servers import API_KEY, Server, engines_behind_router

HOLD_MS = 60  # each decode step: a slow GPU
TOKENS_SEEN_S = 60.0  # bound on the engine generating more tokens


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


@pytest.fixture(scope="module")
def engine(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RouterClient, Server]]:
    with engines_behind_router(model, tmp_path_factory.mktemp("engine"), count=1,
                               flags=("--decode-step-hold-ms", str(HOLD_MS))) as (router, [server]):
        yield router, server


def generated_tokens(server: Server) -> int:
    info = requests.get(server.url + "/server_info", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=10)
    return info.json()["internal_states"][0]["generated_tokens"]


def more_tokens(server: Server, more: int = 1) -> Callable[[], bool]:
    """A condition: the engine generated `more` tokens since it was made (something is mid-generation)."""
    before = generated_tokens(server)
    return lambda: generated_tokens(server) >= before + more
