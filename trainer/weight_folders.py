"""Weight versions published to disk: JOB/weights/<version>/, an HF safetensors folder (shards
with their index, and the model's config and tokenizer, from the job dir's copy of them where
submission kept one: contract.job_dir.MODEL_FILES) that appears, by rename, only once complete;
the newest few are kept."""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from ckpt_tools.safetensors_stream import StreamingSafetensorsWriter
from contract.job_dir import MODEL_FILES, JobDir, fsync_dir

_PARTIAL = ".partial-"  # marks a hidden folder still being written (or being removed)


@dataclass(frozen=True)
class WeightFolders:
    """The version folders of the job dir (JobDir.weights_of): shards of at most shard_bytes,
    keep_versions kept."""

    job_dir: JobDir
    model_files: Path  # where the config and the tokenizer are copied from
    shard_bytes: int
    keep_versions: int

    @property
    def weights_dir(self) -> Path:
        return self.job_dir.weights

    def write(self, version: int, tensors: list[tuple[str, torch.Tensor]]) -> tuple[Path, int]:
        """The folder of `version`, built in a hidden folder and renamed into place, and its bytes."""
        self.weights_dir.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{version}{_PARTIAL}", dir=self.weights_dir))
        try:
            written = write_hf_files(tmp, tensors, self.model_files, self.shard_bytes)
            final = self._move_into_place(tmp, version)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return final, written

    def prune(self, current: Path) -> None:
        """Keep the newest keep_versions folders (current among them); drop what a publisher
        that died mid-write left behind."""
        entries = list(self.weights_dir.iterdir())
        for entry in entries:
            if entry.name.startswith(".") and _PARTIAL in entry.name:
                shutil.rmtree(entry, ignore_errors=True)
        versions = sorted((e for e in entries if e.is_dir() and not e.name.startswith(".") and e != current),
                          key=lambda e: e.stat().st_mtime_ns, reverse=True)
        for old in versions[self.keep_versions - 1:]:
            self._remove(old)

    def _move_into_place(self, tmp: Path, version: int) -> Path:
        """Rename the finished folder in; a folder of the same version (a resumed run publishing
        it again) is removed first, as rename cannot replace a full folder."""
        final = self.job_dir.weights_of(version)
        if final.exists():
            self._remove(final)
        os.rename(tmp, final)
        fsync_dir(self.weights_dir)
        return final

    def _remove(self, folder: Path) -> None:
        """Hide the folder first, so nobody sees it half deleted."""
        hidden = tempfile.mkdtemp(prefix=f".{folder.name}{_PARTIAL}", dir=self.weights_dir)
        os.rename(folder, hidden)  # onto an empty folder, which rename may replace
        shutil.rmtree(hidden, ignore_errors=True)


def write_hf_files(folder: Path, tensors: list[tuple[str, torch.Tensor]], model_files: Path, shard_bytes: int) -> int:
    """An HF checkpoint in the existing folder: safetensors shards with their index, the model's
    config and tokenizer; made durable. Returns the weights' bytes."""
    writer = StreamingSafetensorsWriter(folder, [(n, tuple(t.shape), t.dtype) for n, t in tensors], shard_bytes)
    for name, tensor in tensors:
        writer.write(name, tensor)
    writer.close()
    for side in MODEL_FILES:
        if (model_files / side).is_file():
            shutil.copy2(model_files / side, folder / side)
    fsync_dir(folder)
    return writer.total_bytes


def write_hf_folder(final: Path, tensors: list[tuple[str, torch.Tensor]], model_files: Path, shard_bytes: int) -> None:
    """write_hf_files into `final`, which appears (by rename) only once complete; an existing one is
    replaced."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}{_PARTIAL}", dir=final.parent))
    try:
        write_hf_files(tmp, tensors, model_files, shard_bytes)
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
        fsync_dir(final.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
