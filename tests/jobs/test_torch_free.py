"""The control plane and the command lines' help import no torch and no megatron; the trainer
imports megatron only when --train-backend megatron is chosen. Each case runs in a fresh
interpreter, whose `-X importtime` report names every module it imported."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TORCH_AND_MEGATRON = ("torch", "megatron")


def _imported(python_args: list[str]) -> set[str]:
    """The top-level packages a fresh `python -X importtime ARGS` imports; it must exit 0."""
    run = subprocess.run([sys.executable, "-X", "importtime", *python_args], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    report = [line for line in run.stderr.splitlines() if line.startswith("import time:")]
    return {line.rsplit("|", 1)[1].strip().split(".")[0] for line in report}


@pytest.mark.parametrize("python_args", [
    ["-m", "supervisor", "--help"],
    ["-m", "jobs.cli", "--help"],
    ["-m", "jobs.cli", "status", "--help"],
    ["-m", "jobs.cli", "submit", "--help"],
    ["-m", "jobs.cli", "trace", "--help"],
    ["-m", "rollout", "--help"],
    ["-m", "ckpt_tools", "--help"],
    ["-m", "slurm.devcluster", "--help"],
    ["-c", "import contract.spec, contract.spec_loading, contract.job_dir, contract.control_protocol"],
    ["-c", "import supervisor.cli"],
    ["-c", "import ckpt_tools.tracker"],
    ["-c", "import supervisor.daemon"],
], ids=" ".join)
def test_loads_no_torch_or_megatron(python_args: list[str]) -> None:
    assert _imported(python_args).isdisjoint(TORCH_AND_MEGATRON)


def test_trainer_setup_loads_no_megatron() -> None:
    """The fsdp backend must start without megatron-core installed."""
    assert "megatron" not in _imported(["-c", "import trainer.setup, trainer.fsdp_backend"])
