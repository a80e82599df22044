"""Numerics flags with a process-wide effect: --attention-backend's kernels, --deterministic-mode.

--attention-backend takes Megatron's names (slime passes them through; trainer.config maps them to
slurmrl's two implementations): auto and sdpa run torch's scaled_dot_product_attention and let it
pick a kernel; flash restricts it to the flash kernel (CUDA, or torch's CPU flash kernel where the
backend's calls allow it) and fused to the cuDNN / memory-efficient ones (what TransformerEngine's
fused attention is; CUDA-only); unfused and local run the unfused softmax(QK^T)V attention. Where
each can run: trainer/config/device_checks.py.
"""

from __future__ import annotations

import contextlib
import os

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from trainer.args import ArgsError
from trainer.config.device_checks import attention_backend_problem

_KERNELS = {"flash": [SDPBackend.FLASH_ATTENTION],
            "fused": [SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]}


def check_attention_backend(backend: str, device: torch.device, train_backend: str,
                            context_parallel_size: int = 1) -> None:
    """ArgsError where the backend's kernels cannot run on this device (trainer/config/device_checks.py,
    the rule submission checks too)."""
    problem = attention_backend_problem(backend, "cuda" if device.type == "cuda" else "cpu", train_backend,
                                        context_parallel_size)
    if problem is not None:
        raise ArgsError(problem)


def attention_kernels(backend: str) -> contextlib.AbstractContextManager:
    """The context a forward runs in: SDPA limited to the backend's kernels (none for the others)."""
    return sdpa_kernel(_KERNELS[backend]) if backend in _KERNELS else contextlib.nullcontext()


def apply_deterministic_mode(enabled: bool) -> None:
    """--deterministic-mode, as slime's: deterministic cuDNN, no autotuning, and torch raising on
    any op without a deterministic implementation. cuBLAS needs a fixed workspace for that
    (CUBLAS_WORKSPACE_CONFIG, read when cuBLAS starts), and NCCL a fixed algorithm."""
    if not enabled:
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    os.environ.setdefault("NCCL_ALGO", "Ring")
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(True, warn_only=False)
