"""slime's fully asynchronous rollout, at slime's import path. Given as

    --rollout-function-path slime.rollout.fully_async_rollout.generate_rollout_fully_async

it selects slurmrl's fully asynchronous rollout, which the trainer's loop runs itself
(trainer/fully_async_source.py, rollout/fully_async.py): groups keep generating on the engines
across rollout boundaries, with miles' flags (--max-weight-staleness, --async-data-buffer-capacity-
factor, --async-unused-samples-handler, --pause-generation-mode) and a ledger that a resume loses
nothing from. As in slime it needs the global dataset (--prompt-data) and has no evaluation mode
(evals run the built-in rollout).
"""

from __future__ import annotations

from typing import Any

from trainer.config.sections import FULLY_ASYNC_ROLLOUT

__all__ = ["generate_rollout_fully_async"]


def generate_rollout_fully_async(args: Any, rollout_id: int, data_buffer: Any, evaluation: bool = False) -> Any:
    """Not called: the trainer recognises the path and runs the rollout itself."""
    raise RuntimeError(f"{FULLY_ASYNC_ROLLOUT} is run by slurmrl's trainer, not called: give it as "
                       "--rollout-function-path (a rollout function that wraps it is not supported)")
