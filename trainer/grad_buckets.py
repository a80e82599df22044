"""The data-parallel sum of the gradients, in buckets, as megatron-core's DDP does it.

Each bucket is a run of parameters whose gradients lie one after another in the flat buffer
trainer.main_grads.zero_grads lays out, so it is one in-place all-reduce. Buckets are launched in
one fixed order on every rank (collectives pair up by order): the reverse of the model's, as the
backward pass reaches the last layers first.

With overlap (megatron's --overlap-grad-reduce) a bucket is launched during the last micro-batch's
backward, as soon as every gradient in it is final (post-accumulate-grad hooks), so the reduce runs
under the rest of the backward. Micro-batches before the last run inside no_sync() (megatron's
config.no_sync_func), where nothing is launched: their gradients are not final yet. A bucket with a
gradient the last backward did not touch (an expert no token reached, a rank with fewer micro-batches)
waits, and with it every bucket after it, until finish(). Without overlap, finish() launches every
bucket at once after the backward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
from torch.nn import Parameter

from trainer import main_grads

# megatron's --ddp-bucket-size default: max(40M, 1M x the data-parallel size) elements
MIN_BUCKET_NUMEL = 40_000_000
BUCKET_NUMEL_PER_RANK = 1_000_000


def default_bucket_numel(data_parallel_size: int) -> int:
    return max(MIN_BUCKET_NUMEL, BUCKET_NUMEL_PER_RANK * data_parallel_size)


@dataclass
class _Bucket:
    params: list[Parameter]  # consecutive in the gradient buffer
    group: dist.ProcessGroup
    waiting: set[int] = field(default_factory=set)  # ids of the parameters whose gradient is not final yet


class DataParallelGrads:
    """Sums gradients over their data-parallel groups. runs: (parameters in gradient-buffer order,
    their group); positions: each parameter's place in the model (the launch order is its reverse).
    Call start() once the step's gradients are zeroed, run the backward of every micro-batch but
    the last inside no_sync(), then finish()."""

    def __init__(self, runs: list[tuple[list[Parameter], dist.ProcessGroup]], positions: dict[int, int],
                 bucket_numel: int, overlap: bool) -> None:
        if bucket_numel < 1:
            raise ValueError(f"bucket_numel must be positive, got {bucket_numel}")
        buckets = [bucket for params, group in runs if params and dist.get_world_size(group) > 1
                   for bucket in _cut(params, group, bucket_numel)]
        self._buckets = sorted(buckets, key=lambda b: -max(positions[id(p)] for p in b.params))
        self._bucket_of = {id(p): i for i, b in enumerate(self._buckets) for p in b.params}
        self._open = False  # between start() and finish(): hooks outside a step launch nothing
        self._last_micro_batch = True
        self._launched = 0
        self._works: list[Any] = []
        if overlap:
            for bucket in self._buckets:
                for p in bucket.params:
                    p.register_post_accumulate_grad_hook(self._final)

    @property
    def launched(self) -> int:
        """Buckets launched so far in this step."""
        return self._launched

    def start(self) -> None:
        self._open, self._launched, self._works = True, 0, []
        for bucket in self._buckets:
            bucket.waiting = {id(p) for p in bucket.params}

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """A backward in here is not the last micro-batch's: its gradients are not final."""
        self._last_micro_batch = False
        try:
            yield
        finally:
            self._last_micro_batch = True

    def finish(self) -> None:
        """After the last backward: launch the buckets left, in order, and wait for every one."""
        self._launch(everything=True)
        for work in self._works:
            work.wait()
        self._open, self._works = False, []

    def _final(self, p: Parameter) -> None:
        if self._open and self._last_micro_batch:
            self._buckets[self._bucket_of[id(p)]].waiting.discard(id(p))
            self._launch(everything=False)

    def _launch(self, everything: bool) -> None:
        while self._launched < len(self._buckets):
            bucket = self._buckets[self._launched]
            if bucket.waiting and not everything:
                return
            span = main_grads.flat_span([g for p in bucket.params if (g := main_grads.grad_of(p)) is not None])
            if span is None:
                raise RuntimeError("a gradient bucket is not one run of the gradient buffer: zero_grads lays it out")
            self._works.append(dist.all_reduce(span, group=bucket.group, async_op=True))
            self._launched += 1


def _cut(params: list[Parameter], group: dist.ProcessGroup, bucket_numel: int) -> list[_Bucket]:
    """Consecutive runs of about bucket_numel elements (a parameter is never split)."""
    buckets: list[_Bucket] = []
    run: list[Parameter] = []
    size = 0
    for p in params:
        run.append(p)
        size += p.numel()
        if size >= bucket_numel:
            buckets.append(_Bucket(run, group))
            run, size = [], 0
    if run:
        buckets.append(_Bucket(run, group))
    return buckets
