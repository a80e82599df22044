"""A full disk under --save (a real 8 MiB tmpfs, real torch.save): the save is refused before a byte
is written when the checkpoint cannot fit, or abandoned when the disk fills mid-save anyway; either
way the error names the folder, the free space and the size, no partial folder is left, and the
previous checkpoint stays the latest and loads. A second try fails the same clear way (it used to
say only torch's "unexpected pos ...")."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ckpt_tools.tracker import read_tracker
from trainer import checkpoint
from trainer.save_space import NoSpaceLeft, tensor_bytes

MIB = 1024**2


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    mount = tmp_path / "disk"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8M", "tmpfs", str(mount)], check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", "--lazy", str(mount)], check=True)  # lazy: a file a failed writer left open


def _writer(tensor: torch.Tensor):
    """What a backend's save writes: common.pt (torch.save) and the tensors (torch.distributed.checkpoint)."""
    def write(folder: Path) -> None:
        torch.save({"rollout_id": 0, "rng": tensor[: len(tensor) // 2].clone()}, folder / "common.pt")
        dcp.save({"weights": tensor}, checkpoint_id=folder)
    return write


def _saved_small_checkpoint(save: Path) -> None:
    checkpoint.save(save, 0, _writer(torch.zeros(1024)))
    assert read_tracker(save) == 0


def _assert_nothing_partial_and_previous_latest(save: Path) -> None:
    assert not list(save.glob(".iter_*")), "the partial folder is removed"
    assert sorted(p.name for p in save.iterdir() if p.is_dir()) == ["iter_0000000"]
    assert read_tracker(save) == 0
    assert checkpoint.validate(save / "iter_0000000") is None


def test_a_save_that_cannot_fit_is_refused_before_writing(small_disk: Path) -> None:
    save = small_disk / "ckpt"
    _saved_small_checkpoint(save)
    big = torch.zeros(16 * MIB // 4)
    wrote = []
    with pytest.raises(NoSpaceLeft, match=rf"no space left on {save} \(\d+ MiB free, checkpoint needs ~16 MiB\)"):
        checkpoint.save(save, 1, lambda folder: wrote.append(folder), needs_bytes=tensor_bytes(big))
    assert wrote == [], "nothing was written"
    _assert_nothing_partial_and_previous_latest(save)


def test_a_disk_that_fills_mid_save_is_named_and_cleaned(small_disk: Path) -> None:
    save = small_disk / "ckpt"
    _saved_small_checkpoint(save)
    big = torch.ones(16 * MIB // 4)
    for _ in range(2):  # a second try (what a restart did) fails the same clear way
        with pytest.raises(NoSpaceLeft, match=rf"no space left on {save} \(\d+ MiB free, checkpoint needs ~\d+ MiB\)"):
            checkpoint.save(save, 1, _writer(big), needs_bytes=0)  # the estimate missed: the disk fills
        _assert_nothing_partial_and_previous_latest(save)
    assert checkpoint.find_loadable(save) == save / "iter_0000000"


def test_the_estimate_counts_model_and_optimizer_state() -> None:
    model = torch.nn.Linear(256, 128)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 256)).sum().backward()
    optimizer.step()
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    holder = type("Backend", (), {"__module__": "trainer.fake"})()
    holder.model, holder.optimizer, holder.alias = model, optimizer, [model.weight]  # shared storage counted once
    holder.ref_model = torch.nn.Linear(256, 128)  # not in the checkpoint
    estimate = tensor_bytes(holder)
    assert 3 * params <= estimate <= 3 * params + 64, (estimate, params)  # weights, exp_avg, exp_avg_sq, steps
