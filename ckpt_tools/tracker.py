"""Megatron's save-folder layout, torch-free (the supervisor reads it too): SAVE/iter_XXXXXXX/ or
SAVE/release/, and the tracker file naming the latest."""

from __future__ import annotations

import re
from pathlib import Path

from contract.job_dir import write_atomic

TRACKER = "latest_checkpointed_iteration.txt"


def iteration_dirname(iteration: int | None) -> str:
    """None means the `release` layout."""
    return "release" if iteration is None else f"iter_{iteration:07d}"


def iteration_of(dirname: str) -> int | None:
    """The iteration of an iter_XXXXXXX folder name (iteration_dirname's inverse); None for any other."""
    match = re.fullmatch(r"iter_(\d{7,})", dirname)
    return int(match.group(1)) if match else None


def write_tracker(save_dir: Path, iteration: int | None) -> None:
    """Point the tracker at an iteration (None: release), atomically: a crash leaves the old one."""
    write_atomic(Path(save_dir) / TRACKER, "release" if iteration is None else str(iteration))


def read_tracker(save_dir: Path) -> int | None:
    """The iteration the tracker names (None: release). FileNotFoundError without one, ValueError
    when it holds something else."""
    text = (Path(save_dir) / TRACKER).read_text().strip()
    if text == "release":
        return None
    if not text.isdigit():
        raise ValueError(f"{Path(save_dir) / TRACKER} holds {text!r}, not an iteration or 'release'")
    return int(text)


def resolve_checkpoint(save_dir: Path, step: int | None = None) -> Path:
    """The checkpoint folder for --ckpt-step, else the one the tracker names; or the folder itself."""
    save_dir = Path(save_dir)
    if (save_dir / ".metadata").is_file():
        return save_dir
    if step is not None:
        folder = save_dir / iteration_dirname(step)
    else:
        if not (save_dir / TRACKER).is_file():
            raise FileNotFoundError(f"{save_dir} has no {TRACKER} and no .metadata: not a torch_dist checkpoint")
        folder = save_dir / iteration_dirname(read_tracker(save_dir))
    if not (folder / ".metadata").is_file():
        raise FileNotFoundError(f"{folder} is not a complete torch_dist checkpoint (no .metadata)")
    return folder
