"""Host tensors onto the GPU without stalling it.

A copy from pageable host memory makes CUDA wait for every kernel queued before it (CUDA's API
synchronisation rules), so each pack's inputs copied that way drain the GPU while the host prepares
the next launches: the step becomes bound by the host. Through pinned memory the copy is queued
like a kernel and the host goes on (torch's pinned-memory cache keeps the buffer until the copy ran).
"""

from __future__ import annotations

import torch
from torch import Tensor


def to_device(tensor: Tensor, device: torch.device) -> Tensor:
    if device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)
