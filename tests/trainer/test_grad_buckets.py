"""The data-parallel gradient sum in buckets (trainer/grad_buckets.py), on two gloo ranks that run
different numbers of micro-batches, with a weight one rank's last micro-batch does not touch: the
sums equal one process's gradients of every micro-batch, in fp32 (.grad) and bf16 (main grads),
with and without --overlap-grad-reduce; with it, buckets are launched while the backward is still
running, only in the last micro-batch."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from tests.rank_devices import start_ranks
from trainer import main_grads
from trainer.grad_buckets import DataParallelGrads

WIDTH = 16
BUCKET = WIDTH * WIDTH + WIDTH  # one Linear's weight and bias: each layer a bucket
MICRO_BATCHES = {0: 3, 1: 1}  # rank -> its micro-batches
GROUP_TIMEOUT = timedelta(seconds=60)  # a launch order that differs between ranks hangs: fail instead


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.offset = nn.Parameter(torch.randn(WIDTH))  # first: its bucket is launched last
        self.layers = nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(4)))

    def forward(self, x: torch.Tensor, use_offset: bool) -> tuple[torch.Tensor, torch.Tensor]:
        first = self.layers[0](x + self.offset if use_offset else x)
        return self.layers[1:](torch.tanh(first)), first


def _net(dtype: torch.dtype) -> _Net:
    torch.manual_seed(0)
    net = _Net().to(dtype)
    main_grads.accumulate_in_fp32(net.parameters())
    return net


def _inputs(rank: int, k: int) -> tuple[torch.Tensor, bool]:
    """Micro-batch k of `rank`: the offset is used only in rank 0's last micro-batch."""
    generator = torch.Generator().manual_seed(100 * rank + k)
    return torch.randn(5, WIDTH, generator=generator), rank == 0 and k == MICRO_BATCHES[rank] - 1


def _backward(net: _Net, x: torch.Tensor, use_offset: bool, dtype: torch.dtype,
              at_first_layer: list[int], grads: DataParallelGrads | None = None) -> None:
    out, first = net(x.to(dtype), use_offset)
    if grads is not None:  # what was launched when the backward reached the first layer
        first.register_hook(lambda g: at_first_layer.append(grads.launched))
    out.float().square().sum().backward()


def _reference(dtype: torch.dtype) -> list[torch.Tensor]:
    net = _net(dtype)
    main_grads.zero_grads(list(net.parameters()))
    for rank, count in MICRO_BATCHES.items():
        for k in range(count):
            _backward(net, *_inputs(rank, k), dtype, [])
    return [main_grads.grad_of(p).clone() for p in net.parameters()]


def _worker(rank: int, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=GROUP_TIMEOUT)
    try:
        for dtype in (torch.float32, torch.bfloat16):
            for overlap in (False, True):
                _check(rank, dtype, overlap)
    finally:
        dist.destroy_process_group()


def _check(rank: int, dtype: torch.dtype, overlap: bool) -> None:
    net = _net(dtype)
    params = list(net.parameters())
    grads = DataParallelGrads([(params, dist.group.WORLD)], {id(p): i for i, p in enumerate(params)},
                              BUCKET, overlap)
    main_grads.zero_grads(params)
    grads.start()
    seen: list[int] = []
    for k in range(MICRO_BATCHES[rank]):
        x, use_offset = _inputs(rank, k)
        last = k == MICRO_BATCHES[rank] - 1
        with grads.no_sync() if not last else torch.enable_grad():
            _backward(net, x, use_offset, dtype, seen, grads)
    grads.finish()
    where = f"rank {rank}, {dtype}, overlap {overlap}"
    for p, want in zip(params, _reference(dtype)):
        torch.testing.assert_close(main_grads.grad_of(p), want, rtol=1e-5, atol=1e-5, msg=where)
    # the backward reaches the first layer once layers 4, 3 and 2 (three buckets) have their final gradients
    assert seen[:-1] == [0] * (len(seen) - 1), f"{where}: launched before the last micro-batch: {seen}"
    assert seen[-1] == (3 if overlap else 0), f"{where}: {seen[-1]} buckets launched before the first layer"
    _backward(net, *_inputs(rank, 0), dtype, [])  # a backward outside a step (a probe) launches nothing
    assert grads.launched == 5, where


def test_bucketed_sums_equal_one_process_with_and_without_overlap() -> None:
    from tests.ports import free_port

    start_ranks(_worker, (free_port(),), 2)
