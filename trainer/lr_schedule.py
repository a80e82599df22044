"""The learning-rate schedule shared by the backends (--lr-warmup-iters, --lr-decay-style)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def lr_lambda(args: argparse.Namespace) -> Callable[[int], float]:
    """Megatron's: linear warmup over --lr-warmup-iters optimizer steps, then constant, linear or
    cosine decay to --min-lr at --lr-decay-iters."""
    def factor(step: int) -> float:
        if step < args.lr_warmup_iters:
            return (step + 1) / args.lr_warmup_iters
        if args.lr_decay_style == "constant" or not args.lr_decay_iters:
            return 1.0
        # Megatron counts the step being taken (step + 1) when it decays
        progress = min(1.0, (step + 1 - args.lr_warmup_iters) / max(1, args.lr_decay_iters - args.lr_warmup_iters))
        floor = args.min_lr / args.lr
        kept = 1 - progress if args.lr_decay_style == "linear" else 0.5 * (1 + math.cos(math.pi * progress))
        return floor + (1 - floor) * kept
    return factor
