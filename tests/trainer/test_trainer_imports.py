"""A trainer without --use-wandb does not load wandb (megatron-core's import would: half a second
of every start and restart); with it, wandb loads as before."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROBE = """
import sys
from trainer.__main__ import skip_unused_imports
skip_unused_imports({use_wandb})
import megatron.core, megatron.core.timers
print("wandb loaded" if sys.modules.get("wandb") is not None else "wandb not loaded")
"""


WANDB = importlib.util.find_spec("wandb") is not None


@pytest.mark.parametrize("use_wandb, loaded", [
    (False, "wandb not loaded"),
    pytest.param(True, "wandb loaded", marks=pytest.mark.skipif(not WANDB, reason="wandb is not installed here")),
])
def test_wandb_is_loaded_only_with_use_wandb(use_wandb: bool, loaded: str) -> None:
    done = subprocess.run([sys.executable, "-c", PROBE.format(use_wandb=use_wandb)], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == loaded
