"""fp32 main grads (trainer/main_grads.py): zero_grads lays them out one after another in one flat
buffer, so a reduce can run on that buffer in place (flat_span); tensors that do not tile one run
of memory get no span, and the reduce falls back to a flattened copy."""

from __future__ import annotations

import torch
from torch.nn import Parameter

from tests.rank_devices import start_ranks
from trainer import main_grads


def _bf16_params(*shapes: tuple[int, ...]) -> list[Parameter]:
    params = [Parameter(torch.randn(shape).to(torch.bfloat16)) for shape in shapes]
    main_grads.accumulate_in_fp32(params)
    return params


def test_main_grads_tile_one_buffer_and_its_span_writes_through() -> None:
    params = _bf16_params((3, 4), (5,), (2, 2))
    main_grads.zero_grads(params)
    (sum((p.float() ** 2).sum() for p in params)).backward()
    grads = [main_grads.grad_of(p) for p in params]
    span = main_grads.flat_span(grads)
    assert span is not None and span.numel() == 12 + 5 + 4 and span.dtype == torch.float32
    assert torch.equal(span, torch.cat([g.flatten() for g in grads]))
    span.mul_(2)  # what an all-reduce of the span does: every main grad sees it
    for p, g in zip(params, grads):
        torch.testing.assert_close(g, 4 * p.float())
    # a run in the middle of the buffer (the experts after the dense weights) is a span too
    tail = main_grads.flat_span(grads[1:])
    assert tail is not None and tail.numel() == 9 and tail.data_ptr() == grads[1].data_ptr()


def test_tensors_that_do_not_tile_one_run_have_no_span() -> None:
    params = _bf16_params((3, 4), (5,), (2, 2))
    main_grads.zero_grads(params)
    grads = [main_grads.grad_of(p) for p in params]
    assert main_grads.flat_span([grads[0], grads[2]]) is None  # a gap
    assert main_grads.flat_span([grads[1], grads[0]]) is None  # out of order
    assert main_grads.flat_span([torch.zeros(3), torch.zeros(3)]) is None  # two allocations
    assert main_grads.flat_span([]) is None


def _reduce_worker(rank: int, port: int) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        params = _bf16_params((3, 4), (5,), (2, 2))
        main_grads.zero_grads(params)
        grads = [main_grads.grad_of(p) for p in params]
        for k, g in enumerate(grads):
            g.fill_(10 * rank + k)
        flatten = torch._utils._flatten_dense_tensors
        torch._utils._flatten_dense_tensors = None  # the main grads' reduce must not copy them
        try:
            main_grads.all_reduce_sum(grads, dist.group.WORLD)
        finally:
            torch._utils._flatten_dense_tensors = flatten
        for k, g in enumerate(grads):
            assert torch.all(g == 10 + 2 * k), (rank, k, g)
        separate = [torch.full((3,), float(rank)), torch.full((2,), float(rank + 1))]
        main_grads.all_reduce_sum(separate, dist.group.WORLD)  # no span: through a flattened copy
        assert torch.all(separate[0] == 1) and torch.all(separate[1] == 3)
    finally:
        dist.destroy_process_group()


def test_main_grads_are_all_reduced_in_place_other_tensors_through_a_copy() -> None:
    from tests.ports import free_port

    start_ranks(_reduce_worker, (free_port(),), 2)
