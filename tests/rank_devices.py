"""Where a test's spawned ranks run: one GPU per rank where the machine has enough, else on the CPU
(gloo), as on a machine without a GPU. NCCL refuses two ranks on one GPU ("Duplicate GPU
detected"), and gloo's collectives take CPU tensors only."""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.multiprocessing as mp

# What a rank imports before its first line: forked from a server that holds them, a rank starts at once, where a
# spawned one spends 4-5 s of a 2-core machine importing torch and megatron-core, and the CPU suite starts many.
PRELOADED = ["trainer.megatron.backend", "trainer.fsdp_backend", "transformers"]


def start_ranks(fn: Callable[..., None], args: tuple[Any, ...], nprocs: int) -> None:
    """torch.multiprocessing.start_processes(fn, args, nprocs): on a machine without CUDA the ranks are forked
    from a server that has imported PRELOADED once (torch's forkserver), each with the caller's environment as a
    spawned rank gets it (the server's own is the one it started with); with CUDA they are spawned."""
    if torch.cuda.is_available():  # a CUDA driver touched before a fork is not safe to use after it
        mp.start_processes(fn, args=args, nprocs=nprocs, start_method="spawn")
        return
    multiprocessing.set_forkserver_preload(PRELOADED)  # takes effect when the server starts: the first call
    mp.start_processes(_in_environment, args=(dict(os.environ), fn, *args), nprocs=nprocs, start_method="forkserver")


def stop_rank_server() -> None:
    """Stop start_ranks' server, if one runs (the session's end; multiprocessing's own stop, which its tests use):
    it waits for the server's exit."""
    import multiprocessing.forkserver

    multiprocessing.forkserver._forkserver._stop()


def _in_environment(rank: int, environment: dict[str, str], fn: Callable[..., None], *args: Any) -> None:
    os.environ.clear()
    os.environ.update(environment)
    fn(rank, *args)


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
