"""Room for a checkpoint: how much a save will write (the bytes of the tensors it holds) against the
free space where it goes, checked before a byte is written, and a disk that fills anyway mid-save.
Either way the error is `NoSpaceLeft`: a restart would only repeat the same save, so the trainer
ends with it as its fatal reason (trainer/fatal.py) and the supervisor fails the job with it."""

from __future__ import annotations

import errno
import shutil
from pathlib import Path
from typing import Any

import torch

from trainer.fatal import Fatal

MIB = 1024**2
# A write that failed with less than this free is a full disk, whatever the writer reported (torch.save's
# zip writer says only "iostream error" / "unexpected pos 704 vs 598", without the errno).
FULL_DISK_SLACK = 1 * MIB
# Folders below the backend holding tensors; anything else (args, groups, the driver) is not walked.
_WALK_DEPTH = 4
# Backend attributes a checkpoint does not hold (frozen models loaded from elsewhere).
_NOT_SAVED = frozenset({"ref_model", "teacher_model"})


class NoSpaceLeft(Fatal):
    """The save folder's filesystem cannot hold the checkpoint."""


def tensor_bytes(root: Any) -> int:
    """The bytes of every distinct tensor storage reachable from `root` through modules, optimizers,
    containers and trainer objects: about what a checkpoint of it writes from this process."""
    seen: set[int] = set()
    total = 0

    def walk(obj: Any, depth: int) -> None:
        nonlocal total
        if isinstance(obj, torch.Tensor):
            if obj.device.type == "meta":
                return
            storage = obj.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
            return
        if depth > _WALK_DEPTH or id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, torch.nn.Module):
            for value in obj.state_dict(keep_vars=True).values():
                walk(value, depth + 1)
        elif isinstance(obj, torch.optim.Optimizer):
            walk(obj.state, depth + 1)
            walk(obj.param_groups, depth + 1)
        elif isinstance(obj, dict):
            for value in obj.values():
                walk(value, depth + 1)
        elif isinstance(obj, (list, tuple)):
            for value in obj:
                walk(value, depth + 1)
        elif type(obj).__module__.split(".")[0] in ("trainer", "megatron") and hasattr(obj, "__dict__"):
            for name, value in vars(obj).items():
                if name not in _NOT_SAVED:
                    walk(value, depth + 1)

    walk(root, 0)
    return total


def free_bytes(folder: Path) -> int:
    """Free space for this user on folder's filesystem (its nearest existing parent)."""
    folder = Path(folder)
    while not folder.exists():
        folder = folder.parent
    return shutil.disk_usage(folder).free


def no_space(save_dir: Path, needs: int) -> NoSpaceLeft:
    return NoSpaceLeft(f"no space left on {save_dir} ({free_bytes(save_dir) / MIB:.0f} MiB free, checkpoint "
                       f"needs ~{needs / MIB:.0f} MiB): free space there or point --save elsewhere; "
                       "the previous checkpoint is intact")


def check_room(save_dir: Path, needs: int) -> None:
    """Refuse a save that cannot fit, before anything is written."""
    if needs > free_bytes(save_dir):
        raise no_space(save_dir, needs)


def is_disk_full(err: BaseException, folder: Path) -> bool:
    """Whether a failed write into folder failed for want of space: ENOSPC/EDQUOT anywhere on the
    error's chain, or (for writers that lose the errno) almost no free space left there."""
    cause: BaseException | None = err
    while cause is not None:
        if isinstance(cause, OSError) and cause.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        cause = cause.__cause__ or cause.__context__
    try:
        return free_bytes(folder) < FULL_DISK_SLACK
    except OSError:
        return False
