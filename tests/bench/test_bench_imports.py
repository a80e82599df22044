"""Every benchmark still imports: they run only on demand (often on a GPU machine), so an API
change in the product that a benchmark missed would otherwise first show there."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.mark.parametrize("module", sorted(p.stem for p in BENCH.glob("*.py") if p.stem != "__init__"))
def test_the_benchmark_imports(module: str) -> None:
    importlib.import_module(f"bench.{module}")
