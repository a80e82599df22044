"""Checkpoint folders in Megatron's layout (SAVE/iter_XXXXXXX/, SAVE/latest_checkpointed_iteration.txt),
written so that none is ever half-visible, and found again with damaged ones skipped.

A save builds everything in a hidden temporary folder, writes a manifest (each file's size),
fsyncs, renames the folder into place and only then moves the tracker. A load takes the
tracker's checkpoint if it passes a cheap check (manifest sizes, DCP metadata and its byte
ranges, common.pt), else the newest older one that does, saying why. What goes inside a
folder is the backend's business (`write`); this module only owns the folder.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import random
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import torch
import torch.distributed as dist

from ckpt_tools.torch_dist import read_metadata
from ckpt_tools.tracker import TRACKER, iteration_dirname, iteration_of, read_tracker, write_tracker
from contract.job_dir import fsync_dir, write_atomic
from trainer.save_progress import SaveProgress
from trainer.save_space import NoSpaceLeft, check_room, is_disk_full, no_space

log = logging.getLogger(__name__)

MANIFEST = "slurmrl_manifest.json"
_TMP_MARK = ".tmp-"  # temporary folders: .<iteration folder>.tmp-<random>, never loaded


class CheckpointError(RuntimeError):
    """A checkpoint that was asked for cannot be used; the message says which file and why."""


# ---- saving ------------------------------------------------------------------------------------

def save(save_dir: Path, iteration: int, write: Callable[[Path], None], *, keep: int | None = None,
         group: dist.ProcessGroup | None = None, needs_bytes: int = 0,
         progress: Callable[[], None] | None = None) -> Path:
    """Write checkpoint `iteration` under save_dir and make it the latest. Collective over `group`
    (every rank, or a lone process without torch.distributed): `write(tmp)` is called on every
    rank to fill the temporary folder. Returns save_dir/iter_XXXXXXX.

    keep: how many iter_* folders to keep (the newest by iteration, always the new one).
    needs_bytes: about what this rank writes (summed over ranks): a save the free space cannot
    hold is refused before anything is written. Either way, a full disk raises NoSpaceLeft with
    the temporary folder removed and the previous checkpoint still the latest.
    progress: called on rank 0 (at most every SAVE_PROGRESS_POLL_S) while the save moves on."""
    save_dir = Path(save_dir)
    needs = sum(_gather(needs_bytes, group))
    began = _broadcast(_begin(save_dir, iteration, needs) if _rank(group) == 0 else None, group)
    if isinstance(began, str):
        raise NoSpaceLeft(began)
    watch = SaveProgress(began, progress) if progress is not None and _rank(group) == 0 else None
    with watch or contextlib.nullcontext():
        final = _write_and_publish(save_dir, iteration, began, write, keep, group, needs, watch)
    _barrier(group)  # no rank returns before the checkpoint is the latest
    return final


def _write_and_publish(save_dir: Path, iteration: int, tmp: Path, write: Callable[[Path], None], keep: int | None,
                       group: dist.ProcessGroup | None, needs: int, moving: SaveProgress | None) -> Path:
    """Every rank writes into tmp; rank 0 then makes it durable, renames it into place and moves the tracker."""
    try:
        write(tmp)
        full = False
    except Exception as err:
        if not is_disk_full(err, save_dir):
            raise
        full = True
    if any(_gather(full, group)):  # also the barrier: every rank's files are written (and fsync'd)
        _abandon(tmp, save_dir, needs, group)
    final = save_dir / iteration_dirname(iteration)
    if _rank(group) == 0:
        previous = _tracker_iteration(save_dir)
        try:
            _write_manifest(tmp, iteration)
            _fsync_tree(tmp, moving)
        except OSError as err:
            if not is_disk_full(err, save_dir):
                raise
            _abandon(tmp, save_dir, needs, None)
        _rename_into_place(tmp, final)
        fsync_dir(save_dir)
        write_tracker(save_dir, iteration)
        if keep is not None:
            _prune(save_dir, keep, iteration, previous)
    return final


def _begin(save_dir: Path, iteration: int, needs: int) -> Path | str:
    """The temporary folder to write into, or why there is no room for the checkpoint."""
    tmp = _fresh_tmp(save_dir, iteration)
    try:
        check_room(save_dir, needs)
    except NoSpaceLeft as err:
        shutil.rmtree(tmp, ignore_errors=True)
        return str(err)
    return tmp


def _abandon(tmp: Path, save_dir: Path, needs: int, group: dist.ProcessGroup | None) -> NoReturn:
    """The disk filled mid-save: remove the partial folder (rank 0) and raise NoSpaceLeft on every rank."""
    written = sum(p.stat().st_size for p in tmp.rglob("*") if p.is_file()) if _rank(group) == 0 else 0
    if _rank(group) == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    raise no_space(save_dir, max(needs, written))


def _fresh_tmp(save_dir: Path, iteration: int) -> Path:
    """Remove temporary folders left by crashed saves, then make a new one."""
    save_dir.mkdir(parents=True, exist_ok=True)
    for stale in save_dir.glob(f".*{_TMP_MARK}*"):
        log.info("removing %s, left by an interrupted save", stale)
        shutil.rmtree(stale, ignore_errors=True)
    return Path(tempfile.mkdtemp(prefix=f".{iteration_dirname(iteration)}{_TMP_MARK}", dir=save_dir))


def _write_manifest(folder: Path, iteration: int) -> None:
    files = {str(p.relative_to(folder)): p.stat().st_size for p in sorted(folder.rglob("*")) if p.is_file()}
    write_atomic(folder / MANIFEST, json.dumps({"iteration": iteration, "files": files}, indent=1))


def _fsync_tree(folder: Path, moving: SaveProgress | None = None) -> None:
    """fsync every file and folder below `folder` (writers in other processes may not have);
    `moving` hears of each one done."""
    for path in sorted(folder.rglob("*"), reverse=True):  # files before the folders holding them
        if path.is_dir():
            fsync_dir(path)
        else:
            with open(path, "rb") as f:
                os.fsync(f.fileno())
        if moving is not None:
            moving.moved()
    fsync_dir(folder)


def _rename_into_place(tmp: Path, final: Path) -> None:
    """tmp becomes final. An existing final (the same iteration saved again) is swapped out in
    one atomic exchange where the filesystem supports it, so `final` is never missing."""
    if not final.exists():
        os.rename(tmp, final)
        return
    if not _exchange(tmp, final):
        # No atomic exchange (not Linux, or a filesystem without it): a crash between these two
        # renames leaves no `final`, and the next load falls back to the checkpoint before it.
        aside = final.with_name(f".{final.name}.tmp-replaced-{os.getpid()}")  # ignored, then cleaned
        os.rename(final, aside)
        os.rename(tmp, final)
        tmp = aside
    shutil.rmtree(tmp)  # now the old checkpoint


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (22, 38, 95):  # EINVAL, ENOSYS, EOPNOTSUPP: the filesystem cannot do it
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


def _prune(save_dir: Path, keep: int, just_written: int, previous: int | None) -> None:
    """Delete iter_* folders beyond the newest `keep`; never the one just written, nor the one the
    tracker named before when it is newer than that (a resume from an older checkpoint)."""
    protected = {just_written} | ({previous} if previous is not None and previous > just_written else set())
    ranked = sorted(_iterations(save_dir), reverse=True)
    kept = set(ranked[:max(keep, 1)]) | protected
    for iteration in ranked:
        if iteration not in kept:
            log.info("removing %s (keep=%d)", iteration_dirname(iteration), keep)
            shutil.rmtree(save_dir / iteration_dirname(iteration))


# ---- finding a checkpoint to load --------------------------------------------------------------

def find_loadable(load_dir: Path, ckpt_step: int | None = None) -> Path | None:
    """The checkpoint folder to resume from, or None when load_dir is missing or holds none.

    ckpt_step: exactly that iteration, or CheckpointError. Otherwise the tracker's checkpoint;
    if it is missing or damaged, the newest older one that is intact (with a warning naming what
    is wrong); CheckpointError when there are checkpoints but none is intact. A load_dir that is
    itself a checkpoint folder is returned if intact."""
    load_dir = Path(load_dir)
    if (load_dir / ".metadata").is_file():
        return _checked(load_dir, f"{load_dir}")
    if not load_dir.is_dir():
        return None
    if ckpt_step is not None:
        return _checked(load_dir / iteration_dirname(ckpt_step), f"--ckpt-step {ckpt_step}")
    names = _candidates(load_dir)
    if not names:
        return None
    damaged: list[str] = []
    for name in names:
        problem = validate(load_dir / name)
        if problem is None:
            if damaged:
                log.warning("%s; using %s", "; ".join(damaged), name)
            return load_dir / name
        damaged.append(f"{name} is damaged ({problem})")
    raise CheckpointError(f"no intact checkpoint in {load_dir}: {'; '.join(damaged)}")


def _checked(folder: Path, asked: str) -> Path:
    if not folder.is_dir():
        available = ", ".join(iteration_dirname(i) for i in sorted(_iterations(folder.parent))) or "none"
        raise CheckpointError(f"{asked}: {folder} does not exist (checkpoints there: {available})")
    problem = validate(folder)
    if problem is not None:
        raise CheckpointError(f"{asked}: {folder} is damaged ({problem})")
    return folder


def _candidates(load_dir: Path) -> list[str]:
    """Folder names to try, in order: the tracker's, then every older iteration, newest first,
    then release. With no (readable) tracker: every iteration, newest first."""
    iterations = sorted(_iterations(load_dir), reverse=True)
    release = ["release"] if (load_dir / "release").is_dir() else []
    names = [iteration_dirname(i) for i in iterations] + release
    if not (load_dir / TRACKER).is_file():
        return names
    try:
        latest = read_tracker(load_dir)
    except ValueError as err:
        log.warning("%s; looking for the newest intact checkpoint", err)
        return names
    if latest is None:
        return ["release"]  # a release folder has no iterations before it
    tracked = iteration_dirname(latest)
    return [tracked] + [iteration_dirname(i) for i in iterations if i < latest] + release


def _iterations(save_dir: Path) -> list[int]:
    if not save_dir.is_dir():
        return []
    return [i for p in save_dir.iterdir() if p.is_dir() and (i := iteration_of(p.name)) is not None]


def _tracker_iteration(save_dir: Path) -> int | None:
    try:
        return read_tracker(save_dir)
    except (FileNotFoundError, ValueError):
        return None


def validate(folder: Path) -> str | None:
    """What is wrong with a checkpoint folder, or None if it looks intact. Cheap (no data read):
    the manifest's sizes (folders written by ckpt_tools or Megatron-LM have none), the DCP
    .metadata parses and each stored item lies inside its file, common.pt loads."""
    if not folder.is_dir():
        return "the folder does not exist"
    return _manifest_problem(folder) or _dcp_problem(folder) or _common_problem(folder)


def _manifest_problem(folder: Path) -> str | None:
    path = folder / MANIFEST
    if not path.is_file():
        return None
    try:
        files = json.loads(path.read_text())["files"]
    except (ValueError, KeyError) as err:
        return f"{MANIFEST} does not parse: {err}"
    for name, size in files.items():
        actual = _size(folder / name)
        if actual is None:
            return f"{name} is missing"
        if actual != size:
            return f"{name} is {actual} bytes, the manifest says {size}"
    return None


def _dcp_problem(folder: Path) -> str | None:
    try:
        metadata = read_metadata(folder)
    except FileNotFoundError:
        return ".metadata is missing"
    except Exception as err:  # noqa: BLE001 - any unpickling error means a damaged file
        return f".metadata does not parse: {type(err).__name__}: {err}"
    sizes: dict[str, int | None] = {}
    for index, info in (metadata.storage_data or {}).items():
        if info.relative_path not in sizes:
            sizes[info.relative_path] = _size(folder / info.relative_path)
        size = sizes[info.relative_path]
        if size is None:
            return f"{info.relative_path} is missing"
        if info.offset + info.length > size:
            return (f"{info.relative_path} is {size} bytes, but {index.fqn} is stored at "
                    f"{info.offset}..{info.offset + info.length}")
    return None


def _common_problem(folder: Path) -> str | None:
    path = folder / "common.pt"
    if not path.is_file():
        return "common.pt is missing"
    try:
        torch.load(path, map_location="cpu", weights_only=False)
    except Exception as err:  # noqa: BLE001 - any unpickling error means a damaged file
        return f"common.pt does not load: {type(err).__name__}: {err}"
    return None


def _size(path: Path) -> int | None:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return None


# ---- this process's random generators (every backend keeps them per rank) -----------------------

def process_rng_state() -> dict[str, Any]:
    """python, numpy, torch CPU and (with a GPU) CUDA generator states."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_process_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


# ---- collectives that also work in a lone process ----------------------------------------------

def _rank(group: dist.ProcessGroup | None) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


def _barrier(group: dist.ProcessGroup | None) -> None:
    if dist.is_initialized():
        dist.barrier(group)


def _gather(value: Any, group: dist.ProcessGroup | None) -> list[Any]:
    """Every rank's value, on every rank."""
    if not dist.is_initialized():
        return [value]
    values: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(values, value, group=group)
    return values


def _broadcast(obj: Path | str | None, group: dist.ProcessGroup | None) -> Path | str:
    """Rank 0's value (the other ranks pass None), on every rank."""
    box = [obj]
    if dist.is_initialized():
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group else 0, group=group)
    assert box[0] is not None, "rank 0 has the temporary folder or why there is no room"
    return box[0]
