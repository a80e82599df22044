"""The megatron backend's optimizer: Adam (decoupled weight decay, as megatron's) or SGD, with
megatron's distributed-optimizer sharding and CPU offload.

--use-distributed-optimizer (ZeRO-1, slime's default): each data-parallel rank keeps optimizer
state for, and updates, only the parameters it owns; the owners then broadcast the new values.
Dense weights are split over the DP group, expert weights over the expert-DP group. The torch
optimizer holds only the owned parameters, so the LR scheduler and the checkpoint see a plain
torch optimizer. (megatron-core's DistributedOptimizer allocates on "cuda" in its constructor and
cannot run on a CPU torch; torch's ZeroRedundancyOptimizer takes one process group, not the two
MoE needs, and gathers its state on one rank to save it.)

fp32 master weights: the torch optimizer updates fp32 parameters. Where the model's are fp32 and
stay on the device those are the model's own; with --bf16 parameters (trainer.main_grads) or
--optimizer-cpu-offload they are fp32 copies ("masters"), which take the fp32 gradients before the
step and give the new values back after it (rounded to bf16 where the model is bf16), as megatron's
mixed-precision optimizer does. The checkpoint keeps the masters (trainer.megatron.state).

--optimizer-cpu-offload: the masters live in pinned host memory; the gradients go to the host
before the step and the new values back after it. With --overlap-cpu-optimizer-d2h-h2d the copies
are asynchronous: the gradient copies are queued together with one wait, and the weight copies run
on a side stream while the host goes on (the next forward waits for them). Unlike megatron's
HybridDeviceOptimizer, the CPU step itself is not pipelined with the copies.
On a CPU-only machine the parameters are already in host memory and both change nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn import Parameter

from trainer import main_grads
from trainer.config import OptimizerOptions


class ShardedOptimizer:
    """This rank's share of the optimizer step (all of it without --use-distributed-optimizer)."""

    def __init__(self, named: list[tuple[str, Parameter]], options: OptimizerOptions, lr: float,
                 groups: Callable[[bool], dist.ProcessGroup], is_expert: Callable[[str], bool]) -> None:
        # Dense weights first, then experts: their main grads then tile one buffer run per reduce group.
        self.params = [p for n, p in named if not is_expert(n)] + [p for n, p in named if is_expert(n)]
        self.distributed: bool = options.use_distributed_optimizer
        # (group, owner's global rank, its parameters): every rank takes part in every broadcast.
        self._broadcasts: list[tuple[dist.ProcessGroup, int, list[Parameter]]] = []
        owned = [p for _, p in named]  # the torch optimizer's order, which checkpoints keep
        if options.use_distributed_optimizer:
            owned = []
            for expert in (False, True):
                group = groups(expert)
                size, rank = dist.get_world_size(group), dist.get_rank(group)
                shares = _partition([p for n, p in named if is_expert(n) == expert], size)
                owned += shares[rank]
                if size > 1:
                    self._broadcasts += [(group, dist.get_global_rank(group, r), share)
                                         for r, share in enumerate(shares) if share]
        self.owned: list[Parameter] = owned  # model parameters, in the torch optimizer's order
        self._offload = options.optimizer_cpu_offload and any(p.device.type != "cpu" for p in owned)
        self._overlap = options.overlap_cpu_optimizer_d2h_h2d
        self._stream = torch.cuda.Stream() if self._offload and self._overlap else None
        if self._offload:
            self.masters = [Parameter(p.detach().to("cpu", torch.float32).pin_memory()) for p in owned]
        elif any(p.dtype != torch.float32 for p in owned):
            self.masters = [Parameter(p.detach().to(torch.float32, copy=True)) for p in owned]
        else:
            self.masters = owned
        self.optimizer = _torch_optimizer(self.masters, options, lr)

    def device_masters(self) -> list[Parameter]:
        """fp32 masters that are neither model parameters nor on the host (what offload must move)."""
        return self.masters if self._separate_masters and not self._offload else []

    def zero_grad(self) -> None:
        main_grads.zero_grads(self.params)

    def step(self) -> None:
        if self._separate_masters:
            self._grads_to_masters()
        self.optimizer.step()
        if self._separate_masters:
            self._masters_to_params()
        for group, src, share in self._broadcasts:
            flat = torch._utils._flatten_dense_tensors([p.data for p in share])
            dist.broadcast(flat, src=src, group=group)
            if src != dist.get_rank():
                for p, new in zip(share, torch._utils._unflatten_dense_tensors(flat, share)):
                    p.data.copy_(new)
        main_grads.free_main_grads(self.params)
        if not self._offload:  # they were the main grads; the offloaded masters keep their pinned buffers
            for master in self.masters if self._separate_masters else ():
                master.grad = None

    @property
    def _separate_masters(self) -> bool:
        return self.masters is not self.owned

    def _grads_to_masters(self) -> None:
        for master, p in zip(self.masters, self.owned):
            grad = main_grads.grad_of(p)
            if not self._offload:
                master.grad = grad  # fp32 already, on the same device
                continue
            if grad is None:
                raise RuntimeError("a parameter the optimizer owns has no gradient")
            if master.grad is None:
                master.grad = torch.empty_like(master).pin_memory()
            master.grad.copy_(grad, non_blocking=self._overlap)
        if self._offload:
            torch.cuda.synchronize()  # the step reads the gradients on the host

    @torch.no_grad()
    def _masters_to_params(self) -> None:
        if not self._offload:
            # rounds to the parameters' dtype (Parameters are Tensors: the stub's list is invariant)
            torch._foreach_copy_(cast(list[Tensor], self.owned), cast(list[Tensor], self.masters))
            return
        stream = self._stream or torch.cuda.current_stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for master, p in zip(self.masters, self.owned):
                p.copy_(master, non_blocking=self._overlap)
        torch.cuda.current_stream().wait_stream(stream)  # the next forward reads the new values

    def refresh_masters(self) -> None:
        """After the model's weights were set (a weights-only load, a custom init): the masters
        take them over."""
        if self._separate_masters:
            with torch.no_grad():
                for master, p in zip(self.masters, self.owned):
                    master.data.copy_(p.data)


def _partition(params: list[Parameter], size: int) -> list[list[Parameter]]:
    """Contiguous runs of about equal element counts, one per rank, in model order (every rank
    computes the same split)."""
    total = sum(p.numel() for p in params)
    shares: list[list[Parameter]] = [[] for _ in range(size)]
    seen = 0
    for p in params:
        shares[min(size - 1, seen * size // max(total, 1))].append(p)
        seen += p.numel()
    return shares


def _torch_optimizer(params: list[Parameter], options: OptimizerOptions, lr: float) -> torch.optim.Optimizer:
    if options.optimizer == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=options.sgd_momentum, weight_decay=options.weight_decay)
    # megatron's Adam is AdamW (decoupled weight decay), as is apex's FusedAdam it uses on GPU.
    # fused: one kernel for all parameters where they are all on a GPU
    return torch.optim.AdamW(params, lr=lr, betas=(options.adam_beta1, options.adam_beta2), eps=options.adam_eps,
                             weight_decay=options.weight_decay, fused=bool(params) and all(p.is_cuda for p in params))
