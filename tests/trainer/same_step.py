"""Comparing one RL step (tests.trainer.test_megatron_backend._run's result) between layouts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from ckpt_tools.convert import hf_to_torch_dist
from ckpt_tools.qwen3_5_config import language_model_config
from tests.ckpt_tools.tiny_hf import make_tiny_hf
from tests.rank_devices import rank_devices
from tests.trainer.test_megatron_backend import ATOL, _hf_logps, _samples, run_all


def assert_same_step(base: dict, other: dict, name: str, atol: float = ATOL) -> None:
    """`other` computed the same log-probs and entropies, loss, grad norm and new weights as
    `base`, whose step clipped and moved every weight (else the comparison would prove little)."""
    assert base["metrics"]["clipfrac"] > 0 and base["metrics"]["grad_norm"] > 0.5, "the step must clip to be a test"
    assert other["before"].keys() == base["before"].keys(), f"{name}: every weight is published"
    for i, (want, want_ent) in base["logps"].items():
        assert (other["logps"][i][0] - want).abs().max() < atol, f"{name}: sample {i} log-probs"
        assert (other["logps"][i][1] - want_ent).abs().max() < atol, f"{name}: sample {i} entropies"
    for key in ("loss", "pg_loss", "clipfrac", "grad_norm"):
        assert other["metrics"][key] == pytest.approx(base["metrics"][key], abs=atol), f"{name}: {key}"
    for hf_name, tensor in base["weights"].items():
        assert not torch.equal(tensor, base["before"][hf_name]), f"{hf_name} must move to be a test"
        assert (other["weights"][hf_name] - tensor).abs().max() < atol, f"{name}: {hf_name} after the step"


def assert_same_critic_step(base: dict, other: dict) -> None:
    """The PPO critic's step (and its values after it) are the same in both layouts."""
    base, other = base["critic"], other["critic"]
    for key in ("value_loss", "grad_norm"):
        assert other["metrics"][key] == pytest.approx(base["metrics"][key], abs=ATOL), key
    for i, values in base["values"].items():
        assert values.abs().max() > 1e-3, "the critic step must move the values to be a test"
        assert (other["values"][i] - values).abs().max() < ATOL, f"sample {i}: values after the critic step"


def assert_log_probs_equal_hf(model: Path, results: dict[str, dict], atol: float = ATOL) -> None:
    """Every layout's log-probs are transformers' own, on the model's samples."""
    config = language_model_config(json.loads((model / "config.json").read_text()))
    expected = _hf_logps(model, _samples(config["vocab_size"]))
    for name, result in results.items():
        for i, want in enumerate(expected):
            diff = (result["logps"][i][0] - want).abs().max()
            assert diff < atol, f"{name}: sample {i} log-probs differ from HF's by {diff:.3g}"


def assert_every_name_published(model: Path, results: dict[str, dict]) -> set[str]:
    """Every layout published exactly the checkpoint's names; returns them."""
    with safe_open(str(model / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    for name, result in results.items():
        assert set(result["weights"]) == names, f"{name}: {set(result['weights']) ^ names}"
    return names


def tiny_with_torch_dist(arch: str, root: Path) -> tuple[Path, Path]:
    """A tiny random `arch` (tests.ckpt_tools.tiny_hf) under root, and its conversion to torch_dist."""
    model = make_tiny_hf(arch, root / "model", tied=False)
    return model, hf_to_torch_dist(model, root / "torch_dist", iteration=None, progress=False)


def run_layouts(tiny: tuple[Path, Path], tmp: Path, layouts: dict[str, tuple[int, int, str, list[str]]],
                flags: list[str]) -> dict[str, dict]:
    """run_all over layouts (name: TP, world, attention, extra flags), each with `flags` before its own."""
    with rank_devices(2):
        return run_all(tiny, tmp, {name: (tp, world, attention, [*flags, *extra])
                                   for name, (tp, world, attention, extra) in layouts.items()})
