"""What the trainer's device can run, in one rule checked wherever the device is known: at submission,
from the job spec (a trainer without GPUs runs on CPU: jobs/validate.py), and by each backend once it
has its device (trainer/numerics.py). A job the trainer would refuse, or crash on at its first step,
is then refused before it is submitted."""

from __future__ import annotations

from typing import Literal

Device = Literal["cpu", "cuda"]


def attention_backend_problem(kernels: str, device: Device, train_backend: str,
                              context_parallel_size: int) -> str | None:
    """Why --attention-backend `kernels` (flash: SDPA's flash kernel only; fused: its cuDNN and
    memory-efficient ones) cannot run on this trainer, or None."""
    flag = f"--attention-backend {kernels}"
    if kernels == "fused" and device != "cuda":
        return (f"{flag}: SDPA's cuDNN and memory-efficient kernels run on CUDA only and this trainer runs on "
                f"{device}; use --attention-backend auto" + (" or flash" if train_backend == "fsdp" else ""))
    if kernels == "flash" and train_backend == "fsdp" and device == "cuda":
        return (f"{flag}: the fsdp backend's packed rows carry a block-diagonal mask, which SDPA's CUDA flash "
                "kernel does not take; use --attention-backend auto or fused")
    if kernels not in ("flash", "fused") or train_backend != "megatron":
        return None
    # The megatron backend's packed attention runs flash-attention's varlen kernel on GPUs in bf16;
    # elsewhere it makes an SDPA call per sequence on [heads, tokens, dim] tensors, which no fused
    # kernel takes ("No available kernel" at the first step; seen on CPU and on an H200).
    if device != "cuda":
        return (f"{flag}: this trainer runs on CPU, where the megatron backend's attention has no {kernels} kernel; "
                "use --attention-backend auto (or give the trainer GPUs: --actor-num-gpus-per-node)")
    if context_parallel_size > 1:
        return (f"{flag}: the megatron backend's context-parallel attention has no {kernels} kernel; use "
                "--attention-backend auto")
    return None


def distributed_backend_problem(backend: str | None, device: Device) -> str | None:
    """Why --distributed-backend cannot be this trainer's process group, or None: NCCL needs GPUs,
    and megatron-core's collectives on CUDA tensors need NCCL."""
    wanted = "nccl" if device == "cuda" else "gloo"
    if backend is None or backend == wanted:
        return None
    why = "NCCL needs GPUs" if backend == "nccl" else "the collectives on CUDA tensors need NCCL"
    return f"--distributed-backend {backend}: this trainer runs on {device} and {why}; give {wanted} or drop the flag"


def memory_history_problem(record: bool, device: Device) -> str | None:
    """--record-memory-history records torch's CUDA allocator: nothing to record on CPU."""
    if record and device != "cuda":
        return (f"--record-memory-history: it records the CUDA allocator's history and this trainer runs on {device}; "
                "drop it (or give the trainer GPUs: --actor-num-gpus-per-node)")
    return None
