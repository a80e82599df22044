"""slime's RolloutBatch over slurmrl's TrainSamples: the dict of per-sample lists slime's trainer
plug-ins read and change (--custom-advantage-function-path, --rollout-data-postprocess-path,
--custom-loss-function-path, --custom-tis-function-path), built from the samples and written back.

Keys, as slime's: "tokens" and "unconcat_tokens" (int64 [L] each), "total_lengths",
"response_lengths", "rewards" (the values trained on), "loss_masks" (float [R]), and, where every
sample has them, "log_probs" (the old policy's), "ref_log_probs", "rollout_log_probs",
"teacher_log_probs", "values", "advantages", "returns" ([R] each). slime hands a trainer rank its
data-parallel share; slurmrl hands every rank the whole rollout (every rank computes the same
advantages), and the loss its micro-batch.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from trainer.batch import TrainSample

# TrainSample field -> slime's key
_PER_TOKEN = {"old_log_probs": "log_probs", "ref_log_probs": "ref_log_probs", "rollout_log_probs": "rollout_log_probs",
              "teacher_log_probs": "teacher_log_probs", "values": "values", "advantages": "advantages",
              "returns": "returns"}
WRITABLE = ("advantages", "returns", "loss_masks")  # what plug-ins may change, and slurmrl reads back


def rollout_batch(samples: list[TrainSample], device: torch.device | None = None) -> dict[str, Any]:
    tokens = [s.tokens for s in samples]
    batch: dict[str, Any] = {
        "tokens": tokens, "unconcat_tokens": tokens, "total_lengths": [int(s.tokens.numel()) for s in samples],
        "response_lengths": [s.response_length for s in samples], "rewards": [s.reward for s in samples],
        "loss_masks": [s.loss_mask.to(device) if device else s.loss_mask for s in samples]}
    for field, key in _PER_TOKEN.items():
        values = [getattr(s, field) for s in samples]
        if all(v is not None for v in values):
            batch[key] = [v.to(device) if device else v for v in values]
    return batch


def write_back(batch: dict[str, Any], samples: list[TrainSample], flag: str) -> None:
    """The WRITABLE keys of a plug-in's batch back onto the samples: one [R] tensor per sample
    (ValueError naming `flag` otherwise)."""
    for key in WRITABLE:
        if key not in batch:
            continue
        values = batch[key]
        if not isinstance(values, (list, tuple)) or len(values) != len(samples):
            raise ValueError(f"{flag} left rollout_data[{key!r}] as {type(values).__name__}: give one tensor per "
                             f"sample ({len(samples)})")
        for sample, value in zip(samples, values):
            tensor = torch.as_tensor(value, dtype=torch.float32).detach().cpu().reshape(-1)
            if tensor.numel() != sample.response_length:
                raise ValueError(f"{flag} left rollout_data[{key!r}] with {tensor.numel()} values for a sample of "
                                 f"{sample.response_length} response tokens")
            setattr(sample, "loss_mask" if key == "loss_masks" else key, tensor)


def concat(values: list[Tensor]) -> Tensor:
    """slime's per-token layout: every sample's response tokens, one after another."""
    return torch.cat([v.reshape(-1) for v in values]) if values else torch.zeros(0)
