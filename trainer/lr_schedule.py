"""The learning-rate schedule shared by the backends: Megatron's (OptimizerParamScheduler)."""

from __future__ import annotations

import math
from collections.abc import Callable

from trainer.config import OptimizerOptions


def lr_lambda(opt: OptimizerOptions) -> Callable[[int], float]:
    """The factor on --lr for optimizer step `step` (0, 1, ...), as Megatron computes it with
    num_steps = step: linear warmup over --lr-warmup-iters (Megatron's first warmup step has
    factor 0), then constant, linear or cosine decay to --min-lr at --lr-decay-iters."""
    def factor(step: int) -> float:
        warmup = opt.lr_warmup_iters
        if warmup > 0 and step <= warmup:
            return step / warmup
        if opt.lr_decay_style == "constant" or not opt.lr_decay_iters:
            return 1.0
        floor = opt.min_lr / opt.lr
        if step > opt.lr_decay_iters:
            return floor
        progress = (step - warmup) / max(1, opt.lr_decay_iters - warmup)
        kept = 1 - progress if opt.lr_decay_style == "linear" else 0.5 * (1 + math.cos(math.pi * progress))
        return floor + (1 - floor) * kept
    return factor
