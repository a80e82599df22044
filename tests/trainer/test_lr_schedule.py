"""The learning-rate schedule is Megatron's: each step's lr equals megatron-core's
OptimizerParamScheduler's for the same flags (warmup, then constant, linear or cosine decay)."""

from __future__ import annotations

import argparse

import pytest
import torch

from trainer.lr_schedule import lr_lambda


def _megatron_lrs(lr: float, min_lr: float, warmup: int, decay: int, style: str, steps: int) -> list[float]:
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    scheduler = OptimizerParamScheduler(optimizer, init_lr=0.0, max_lr=lr, min_lr=min_lr, lr_warmup_steps=warmup,
                                        lr_decay_steps=decay, lr_decay_style=style, start_wd=0.0, end_wd=0.0,
                                        wd_incr_steps=1, wd_incr_style="constant")
    out = []
    for _ in range(steps):  # the lr each optimizer step runs with; the scheduler steps after it
        out.append(optimizer.param_groups[0]["lr"])
        scheduler.step(1)
    return out


@pytest.mark.parametrize("style, warmup", [("constant", 3), ("linear", 2), ("cosine", 2), ("cosine", 0)])
def test_each_step_lr_equals_megatron_cores(style: str, warmup: int) -> None:
    lr, min_lr, decay, steps = 1e-5, 1e-6, 10, 14
    args = argparse.Namespace(lr=lr, min_lr=min_lr, lr_warmup_iters=warmup, lr_decay_iters=decay, lr_decay_style=style)
    ours = [lr * lr_lambda(args)(step) for step in range(steps)]
    assert ours == pytest.approx(_megatron_lrs(lr, min_lr, warmup, decay, style, steps), rel=1e-9)
