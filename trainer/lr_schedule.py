"""The learning-rate schedule shared by the backends: Megatron's (OptimizerParamScheduler)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def lr_lambda(args: argparse.Namespace) -> Callable[[int], float]:
    """The factor on --lr for optimizer step `step` (0, 1, ...), as Megatron computes it with
    num_steps = step: linear warmup over --lr-warmup-iters (Megatron's first warmup step has
    factor 0), then constant, linear or cosine decay to --min-lr at --lr-decay-iters."""
    def factor(step: int) -> float:
        warmup = args.lr_warmup_iters
        if warmup > 0 and step <= warmup:
            return step / warmup
        if args.lr_decay_style == "constant" or not args.lr_decay_iters:
            return 1.0
        floor = args.min_lr / args.lr
        if step > args.lr_decay_iters:
            return floor
        progress = (step - warmup) / max(1, args.lr_decay_iters - warmup)
        kept = 1 - progress if args.lr_decay_style == "linear" else 0.5 * (1 + math.cos(math.pi * progress))
        return floor + (1 - floor) * kept
    return factor
