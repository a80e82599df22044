"""Builds what `python -m trainer` runs: the backend, the loop, and where the weights start."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist

from ckpt_tools.tracker import resolve_checkpoint
from trainer import dist_env
from trainer.args import ArgsError, check_model_flags, read_hf_config
from trainer.loop import Loop, seed_everything
from trainer.loop_builder import build_loop
from trainer.numerics import apply_deterministic_mode


def build(args: argparse.Namespace) -> tuple[Loop, Path | None, Callable[[], None] | None]:
    """(loop, initial torch_dist weights or None, a function loading the reference model or None)."""
    hf_config = read_hf_config(args.hf_checkpoint)
    check_model_flags(args, hf_config)
    dist_env.init_process_group()
    seed_everything(args.seed)
    apply_deterministic_mode(args.deterministic_mode)
    if args.train_backend == "fsdp":
        from trainer.fsdp_backend import FSDPBackend

        backend = FSDPBackend.from_args(args)
        return build_loop(args, backend), None, None
    # Imported only when chosen: the fsdp backend runs without megatron-core installed.
    from trainer.megatron.backend import MegatronBackend

    backend = MegatronBackend(args, hf_config)
    initial = initial_weights(args, backend.rank == 0, backend.cpu_group)
    if args.opd_teacher_load:
        backend.load_teacher(_resolve("--opd-teacher-load", args.opd_teacher_load, args.opd_teacher_ckpt_step))
    load_reference = (lambda: backend.load_reference(initial)) if args.ref_model_needed else None
    return build_loop(args, backend), initial, load_reference


def _resolve(flag: str, path: str, step: int | None = None) -> Path:
    try:
        return resolve_checkpoint(Path(path), step)
    except (FileNotFoundError, ValueError) as err:
        raise ArgsError(f"{flag}: {err}") from None


def initial_weights(args: argparse.Namespace, rank0: bool, group) -> Path:
    """--ref-load's checkpoint; without one, --hf-checkpoint converted once into the job dir."""
    if args.ref_load:
        return _resolve("--ref-load", args.ref_load, args.ref_ckpt_step)
    converted = Path(args.job_dir) / "hf_torch_dist"
    if rank0 and not converted.exists():
        from ckpt_tools.convert import hf_to_torch_dist

        hf_to_torch_dist(Path(args.hf_checkpoint), converted, iteration=None, progress=False)
    dist.barrier(group=group)
    return resolve_checkpoint(converted)
