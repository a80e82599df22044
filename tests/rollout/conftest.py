"""Fixtures of the rollout tests: the tiny model, and two CPU engines behind a real router (a
module may define its own `model` or `cluster` instead)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from rollout.router_client import RouterClient
from rollout.tiny_model import write_tiny_model
from tests.rollout.servers import Server, engines_behind_router


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


@pytest.fixture
def cluster(model: Path, tmp_path: Path) -> Iterator[tuple[RouterClient, list[Server]]]:
    with engines_behind_router(model, tmp_path) as pair:
        yield pair
