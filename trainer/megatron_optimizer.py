"""The megatron backend's optimizer: Adam (decoupled weight decay, as megatron's) or SGD, with
megatron's distributed-optimizer sharding and CPU offload.

--use-distributed-optimizer (ZeRO-1, slime's default): each data-parallel rank keeps optimizer
state for, and updates, only the parameters it owns; the owners then broadcast the new values.
Dense weights are split over the DP group, expert weights over the expert-DP group. The torch
optimizer holds only the owned parameters, so the LR scheduler and the checkpoint see a plain
torch optimizer. (megatron-core's DistributedOptimizer allocates on "cuda" in its constructor and
cannot run on a CPU torch; torch's ZeroRedundancyOptimizer takes one process group, not the two
MoE needs, and gathers its state on one rank to save it.)

--optimizer-cpu-offload: the optimizer updates fp32 CPU copies of the (owned) parameters; the
gradients go to the host before the step and the new values back after it. With
--overlap-cpu-optimizer-d2h-h2d the copies are asynchronous (pinned memory): the gradient copies
are queued together with one wait, and the weight copies run on a side stream while the host goes
on (the next forward waits for them). Unlike megatron's HybridDeviceOptimizer, the CPU step itself
is not pipelined with the copies.
On a CPU-only machine the parameters are already in host memory and both change nothing.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.nn import Parameter


class ShardedOptimizer:
    """This rank's share of the optimizer step (all of it without --use-distributed-optimizer)."""

    def __init__(self, named: list[tuple[str, Parameter]], args: argparse.Namespace, lr: float,
                 groups: Callable[[bool], dist.ProcessGroup], is_expert: Callable[[str], bool]) -> None:
        self.params = [p for _, p in named]
        self.distributed: bool = args.use_distributed_optimizer
        # (group, owner's global rank, its parameters): every rank takes part in every broadcast.
        self._broadcasts: list[tuple[dist.ProcessGroup, int, list[Parameter]]] = []
        owned = self.params
        if args.use_distributed_optimizer:
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
        self._offload = args.optimizer_cpu_offload and any(p.device.type != "cpu" for p in owned)
        self._overlap = args.overlap_cpu_optimizer_d2h_h2d
        if self._offload:
            self._host = [Parameter(p.detach().to("cpu", torch.float32).pin_memory()) for p in owned]
            self._stream = torch.cuda.Stream() if self._overlap else None
        else:
            self._host = owned
        self.optimizer = _torch_optimizer(self._host, args, lr)

    def zero_grad(self) -> None:
        for p in self.params:
            if p.grad is not None:
                p.grad.zero_()

    def step(self) -> None:
        if self._offload:
            self._to_host()
        self.optimizer.step()
        if self._offload:
            self._to_device()
        for group, src, share in self._broadcasts:
            flat = torch._utils._flatten_dense_tensors([p.data for p in share])
            dist.broadcast(flat, src=src, group=group)
            if src != dist.get_rank():
                for p, new in zip(share, torch._utils._unflatten_dense_tensors(flat, share)):
                    p.data.copy_(new)

    def _to_host(self) -> None:
        for host, p in zip(self._host, self.owned):
            if host.grad is None:
                host.grad = torch.empty_like(host).pin_memory()
            host.grad.copy_(p.grad, non_blocking=self._overlap)
        torch.cuda.synchronize()  # the step reads the gradients on the host

    def _to_device(self) -> None:
        stream = self._stream or torch.cuda.current_stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for host, p in zip(self._host, self.owned):
                p.data.copy_(host.data, non_blocking=self._overlap)
        torch.cuda.current_stream().wait_stream(stream)  # the next forward reads the new values

    def refresh_host_copies(self) -> None:
        """After the model's weights were set (a checkpoint load, a custom init): the host copies
        the offloaded optimizer updates take them over."""
        if self._offload:
            for host, p in zip(self._host, self.owned):
                host.data.copy_(p.data)


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


def _torch_optimizer(params: list[Parameter], args: argparse.Namespace, lr: float) -> torch.optim.Optimizer:
    if args.optimizer == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=args.sgd_momentum, weight_decay=args.weight_decay)
    # megatron's Adam is AdamW (decoupled weight decay), as is apex's FusedAdam it uses on GPU.
    return torch.optim.AdamW(params, lr=lr, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_eps,
                             weight_decay=args.weight_decay)
