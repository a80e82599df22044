"""Builds what `python -m trainer` runs: the backend, the loop, and where the weights start."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist

from ckpt_tools.tracker import resolve_checkpoint
from contract.job_dir import JobDir
from trainer import dist_env
from trainer.args import ArgsError, check_model_flags, read_hf_config
from trainer.config import CheckpointOptions, TrainerConfig
from trainer.loop import Loop, seed_everything
from trainer.loop_builder import build_loop
from trainer.numerics import apply_deterministic_mode


def build(config: TrainerConfig) -> tuple[Loop, Path | None, Callable[[], None] | None]:
    """(loop, initial torch_dist weights or None, a function loading the reference model or None)."""
    model = config.model
    hf_config = read_hf_config(model.model_files)
    check_model_flags(config.shape, model.hf_checkpoint, hf_config)
    dist_env.init_process_group(config.run.distributed_backend, config.run.distributed_timeout_minutes)
    seed_everything(model.seed)
    apply_deterministic_mode(model.deterministic_mode)
    if model.train_backend == "fsdp":
        from trainer.fsdp_backend import FSDPBackend

        return build_loop(config, FSDPBackend.from_config(config)), None, None
    # Imported only when chosen: the fsdp backend runs without megatron-core installed.
    from trainer.megatron.backend import MegatronBackend

    backend = MegatronBackend(config, hf_config)
    ckpt = config.checkpoint
    initial = initial_weights(ckpt, model.hf_checkpoint, config.run.job_dir, backend.rank == 0, backend.cpu_group,
                              model.mtp_num_layers or 0)
    if ckpt.opd_teacher_load:
        backend.load_teacher(_resolve("--opd-teacher-load", ckpt.opd_teacher_load, ckpt.opd_teacher_ckpt_step))
    load_reference = (lambda: backend.load_reference(initial)) if config.loss.ref_model_needed else None
    return build_loop(config, backend), initial, load_reference


def _resolve(flag: str, path: str, step: int | None = None) -> Path:
    try:
        return resolve_checkpoint(Path(path), step)
    except (FileNotFoundError, ValueError) as err:
        raise ArgsError(f"{flag}: {err}") from None


def initial_weights(ckpt: CheckpointOptions, hf_checkpoint: str, job_dir: str, rank0: bool,
                    group: dist.ProcessGroup | None, mtp_layers: int = 0) -> Path:
    """--ref-load's checkpoint; without one, --hf-checkpoint converted once into the job dir (with
    its first `mtp_layers` MTP layers)."""
    if ckpt.ref_load:
        return _resolve("--ref-load", ckpt.ref_load, ckpt.ref_ckpt_step)
    converted = JobDir(Path(job_dir)).hf_torch_dist
    if rank0 and not converted.exists():
        from ckpt_tools.convert import hf_to_torch_dist

        hf_to_torch_dist(Path(hf_checkpoint), converted, iteration=None, mtp_layers=mtp_layers, progress=False)
    dist.barrier(group=group)
    return resolve_checkpoint(converted)
