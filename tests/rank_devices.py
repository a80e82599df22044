"""Where a test's spawned ranks run: one GPU per rank where the machine has enough, else on the CPU
(gloo), as on a machine without a GPU. NCCL refuses two ranks on one GPU ("Duplicate GPU
detected"), and gloo's collectives take CPU tensors only."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch


def hidden_gpus(world: int) -> dict[str, str]:
    """Environment for `world` ranks started as subprocesses: empty if each can have a GPU, else
    one that hides the GPUs."""
    return {} if torch.cuda.device_count() >= world else {"CUDA_VISIBLE_DEVICES": ""}


@contextmanager
def rank_devices(world: int) -> Iterator[str]:
    """Within it, processes spawned for `world` ranks see one GPU each, or none when there are
    fewer GPUs than ranks. Yields the device type they run on. Wrap every run a test compares in
    one such block (sized for the largest run), so that all of them run on the same device."""
    hide = hidden_gpus(world)
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ.update(hide)
    try:
        yield "cpu" if hide or not torch.cuda.is_available() else "cuda"
    finally:
        if saved is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved


def init_rank(rank: int, world: int, init_file: str) -> None:
    """In a spawned rank: the default process group, NCCL on this rank's own GPU where
    rank_devices left it one, else gloo."""
    backend = "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(rank)
        backend = "nccl"
    torch.distributed.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world)
