"""Comparing one RL step (tests.trainer.test_megatron_backend._run's result) between layouts."""

from __future__ import annotations

import pytest
import torch

from tests.trainer.test_megatron_backend import ATOL


def assert_same_step(base: dict, other: dict, name: str) -> None:
    """`other` computed the same log-probs and entropies, loss, grad norm and new weights as
    `base`, whose step clipped and moved every weight (else the comparison would prove little)."""
    assert base["metrics"]["clipfrac"] > 0 and base["metrics"]["grad_norm"] > 0.5, "the step must clip to be a test"
    assert other["before"].keys() == base["before"].keys(), f"{name}: every weight is published"
    for i, (want, want_ent) in base["logps"].items():
        assert (other["logps"][i][0] - want).abs().max() < ATOL, f"{name}: sample {i} log-probs"
        assert (other["logps"][i][1] - want_ent).abs().max() < ATOL, f"{name}: sample {i} entropies"
    for key in ("loss", "pg_loss", "clipfrac", "grad_norm"):
        assert other["metrics"][key] == pytest.approx(base["metrics"][key], abs=ATOL), f"{name}: {key}"
    for hf_name, tensor in base["weights"].items():
        assert not torch.equal(tensor, base["before"][hf_name]), f"{hf_name} must move to be a test"
        assert (other["weights"][hf_name] - tensor).abs().max() < ATOL, f"{name}: {hf_name} after the step"


def assert_same_critic_step(base: dict, other: dict) -> None:
    """The PPO critic's step (and its values after it) are the same in both layouts."""
    base, other = base["critic"], other["critic"]
    for key in ("value_loss", "grad_norm"):
        assert other["metrics"][key] == pytest.approx(base["metrics"][key], abs=ATOL), key
    for i, values in base["values"].items():
        assert values.abs().max() > 1e-3, "the critic step must move the values to be a test"
        assert (other["values"][i] - values).abs().max() < ATOL, f"sample {i}: values after the critic step"
