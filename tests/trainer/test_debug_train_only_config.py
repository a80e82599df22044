"""slime's --debug-train-only in the trainer's configuration: --load-debug-rollout-data sets it (slime's
arguments.py: "will not instantiate sglang servers"), so such a trainer needs no router and publishes no
weights; a rollout that generates on engines is refused with it (the job starts none)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from rollout.tiny_model import write_tiny_model
from trainer.args import ArgsError, parse_args
from trainer.config.sections import FULLY_ASYNC_ROLLOUT


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def test_loading_saved_rollouts_is_debug_train_only_without_a_router(model: Path) -> None:
    config = parse_args(["--hf-checkpoint", str(model), "--num-rollout", "2", "--n-samples-per-prompt", "2",
                         "--load-debug-rollout-data", "dump/{rollout_id}.pt"])
    assert config.run.debug_train_only and config.publish.router_url is None


@pytest.mark.parametrize("flags, message", [
    (["--rollout-function-path", "slime.rollout.sglang_rollout.generate_rollout"],
     "--debug-train-only needs --load-debug-rollout-data"),
    (["--rollout-function-path", FULLY_ASYNC_ROLLOUT, "--prompt-data", "p.jsonl"],
     f"--debug-train-only starts no engines, and --rollout-function-path {FULLY_ASYNC_ROLLOUT} generates on them"),
])
def test_a_rollout_on_engines_is_refused_without_engines(model: Path, flags: list[str], message: str) -> None:
    with pytest.raises(ArgsError, match=re.escape(message)):
        parse_args(["--hf-checkpoint", str(model), "--num-rollout", "1", "--debug-train-only", *flags])
