"""The learning-rate schedule is Megatron's: each step's lr equals megatron-core's
OptimizerParamScheduler's for the same flags (warmup, then constant, linear or cosine decay)."""

from __future__ import annotations

import pytest
import torch

from trainer.config import OptimizerOptions
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
    options = OptimizerOptions(lr=lr, min_lr=min_lr, lr_warmup_iters=warmup, lr_warmup_fraction=None,
                               lr_decay_style=style, lr_decay_iters=decay, weight_decay=0.0, adam_beta1=0.9,
                               adam_beta2=0.999, adam_eps=1e-8, clip_grad=1.0, optimizer="adam", sgd_momentum=0.9,
                               use_distributed_optimizer=True, optimizer_cpu_offload=False,
                               overlap_cpu_optimizer_d2h_h2d=False, use_precision_aware_optimizer=False, critic_lr=None,
                               check_for_nan_in_loss_and_grad=True)
    ours = [lr * lr_lambda(options)(step) for step in range(steps)]
    assert ours == pytest.approx(_megatron_lrs(lr, min_lr, warmup, decay, style, steps), rel=1e-9)
