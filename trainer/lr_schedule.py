"""The learning-rate schedule shared by the backends (--lr-warmup-iters, --lr-decay-style)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def lr_lambda(args: argparse.Namespace) -> Callable[[int], float]:
    """Linear warmup over --lr-warmup-iters optimizer steps, then constant or cosine decay to --min-lr."""
    def factor(step: int) -> float:
        if step < args.lr_warmup_iters:
            return (step + 1) / args.lr_warmup_iters
        if args.lr_decay_style == "constant" or not args.lr_decay_iters:
            return 1.0
        progress = min(1.0, (step - args.lr_warmup_iters) / max(1, args.lr_decay_iters - args.lr_warmup_iters))
        floor = args.min_lr / args.lr
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    return factor
