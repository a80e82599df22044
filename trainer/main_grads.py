"""fp32 gradients for bf16 parameters (--bf16), as megatron-core's DDP keeps them: each parameter's
gradient is added into an fp32 `main_grad` as soon as autograd has accumulated it, and the bf16
`.grad` is dropped. Micro-batches therefore sum in fp32, and the data-parallel reduce, the norm,
the clipping and the optimizer read fp32 values. fp32 parameters keep their plain `.grad`.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn import Parameter

# The fp32 gradient's attribute on a Parameter (megatron-core's name), set and read dynamically
_MAIN_GRAD = "main_grad"


def accumulate_in_fp32(params: Iterable[Parameter]) -> None:
    """Give every trainable low-precision parameter an fp32 main_grad, filled by a hook."""
    for p in params:
        if p.requires_grad and p.dtype != torch.float32 and not hasattr(p, _MAIN_GRAD):
            setattr(p, _MAIN_GRAD, None)
            p.register_post_accumulate_grad_hook(_into_main_grad)


def _into_main_grad(p: Parameter) -> None:
    grad = p.grad
    assert grad is not None, "the hook runs once autograd has accumulated .grad"
    main: Tensor | None = getattr(p, _MAIN_GRAD)
    if main is None:
        setattr(p, _MAIN_GRAD, grad.float())
    else:
        main.add_(grad)
    p.grad = None


def grad_of(p: Parameter) -> Tensor | None:
    """The gradient the optimizer will apply: main_grad where there is one, else .grad."""
    return getattr(p, _MAIN_GRAD) if hasattr(p, _MAIN_GRAD) else p.grad


def zero_grads(params: Iterable[Parameter]) -> None:
    """Start a step: every gradient a zero fp32 view into one flat buffer per device, in the order
    given (one allocation and one fill, not one per parameter; every rank then reduces the same
    tensors, sampled or not, each bucket of trainer.grad_buckets one run of the buffer): the
    main_grad of a low-precision parameter, the .grad of an fp32 one (autograd adds into an existing
    .grad in place). Other gradients are zeroed in place."""
    flat_grads: dict[torch.device, list[Parameter]] = {}
    for p in params:
        if hasattr(p, _MAIN_GRAD) or p.dtype == torch.float32:
            flat_grads.setdefault(p.device, []).append(p)
        elif p.grad is not None:
            p.grad.zero_()
    for device, group in flat_grads.items():
        flat = torch.zeros(sum(p.numel() for p in group), dtype=torch.float32, device=device)
        offset = 0
        for p in group:
            view = flat[offset:offset + p.numel()].view_as(p)
            if hasattr(p, _MAIN_GRAD):
                setattr(p, _MAIN_GRAD, view)
            else:
                p.grad = view
            offset += p.numel()


def free_main_grads(params: Iterable[Parameter]) -> None:
    """After the optimizer step: the fp32 buffers go (their memory serves rollouts, offload moves nothing)."""
    for p in params:
        if hasattr(p, _MAIN_GRAD):
            setattr(p, _MAIN_GRAD, None)


def flat_span(grads: list[Tensor]) -> Tensor | None:
    """One flat view of the memory these tensors tile, in this order, with no gap (main grads that
    zero_grads laid out one after another); None if they do not. A reduce of the view reduces them
    all in place, without the copy in and out of a flattened tensor."""
    if not grads:
        return None
    first = grads[0]
    storage, end = first.untyped_storage(), first.storage_offset()
    for g in grads:
        if (g.untyped_storage().data_ptr() != storage.data_ptr() or g.storage_offset() != end
                or g.dtype != first.dtype or not g.is_contiguous()):
            return None
        end += g.numel()
    return first.new_empty(0).set_(storage, first.storage_offset(), (end - first.storage_offset(),), (1,))


def all_reduce_sum(grads: list[Tensor], group: dist.ProcessGroup | None) -> None:
    """One coalesced all-reduce of these tensors, in place: of the buffer they tile where they do
    (the main grads), else of a flattened copy."""
    if not grads or dist.get_world_size(group) == 1:
        return
    if (span := flat_span(grads)) is not None:
        dist.all_reduce(span, group=group)
        return
    flat = torch._utils._flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=group)
    for g, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
        g.copy_(synced)
