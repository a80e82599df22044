"""Plug-ins the trainer tests load by name (--custom-rm-path and friends)."""

from __future__ import annotations


def zero_reward(args, sample) -> float:
    """No reward at all: what is learnt then comes from another signal (a teacher's log-probs)."""
    return 0.0


def slow_toy_reward(args, sample) -> float:
    """The toy reward from a slow reward model (20 ms a sample, blocking the rollout's event loop,
    so a rollout of 64 samples takes at least 1.3 s): work whose duration tests can count on."""
    import time

    from rollout.rewards import toy_reward

    time.sleep(0.02)
    return toy_reward(sample.response, sample.label)


def die_in_rollout(args, sample, *, rollout_id, evaluation) -> None:
    """--rollout-sample-hook-path: the trainer dies at once, as a killed one does (nothing saved,
    nothing flushed), in the rollout that SLURMRL_TEST_DIE_IN_ROLLOUT names; otherwise a no-op."""
    import os

    if not evaluation and os.environ.get("SLURMRL_TEST_DIE_IN_ROLLOUT") == str(rollout_id):
        os._exit(137)
