"""A slow save is not a hung one (issue 29, item 6): while rank 0 saves, the trainer's heartbeat
beats again on every sign of progress (a file written or grown in the checkpoint's folder, an
fsync done), so the supervisor's trainer_save_timeout bounds a save without progress, not a long
one. A save that makes no progress beats nothing. The whole job on the devcluster:
tests/integration/test_deadline.py."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from ckpt_tools.tracker import read_tracker
from contract.job_dir import JobDir, Phase, read_heartbeat
from trainer import checkpoint
from trainer.metrics import Reporter
from trainer.save_progress import SAVE_PROGRESS_POLL_S

FSYNC_S = 0.25  # each fsync on the slow filesystem
SLACK_S = 0.5  # a loaded machine's lateness on top of a poll


@pytest.fixture
def slow_fsync(monkeypatch: pytest.MonkeyPatch) -> None:
    real = os.fsync

    def fsync(fd: int) -> None:
        time.sleep(FSYNC_S)
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)


def _write_shards(folder: Path) -> None:
    """Four shards, each fsync'd as torch's checkpoint writers do."""
    for k in range(4):
        with open(folder / f"__0_{k}.distcp", "wb") as f:
            f.write(b"x" * 4096)
            f.flush()
            os.fsync(f.fileno())


def test_a_slow_save_beats_on_each_step_of_progress(tmp_path: Path, slow_fsync) -> None:
    beats: list[float] = []
    began = time.monotonic()
    checkpoint.save(tmp_path / "save", 3, _write_shards, progress=lambda: beats.append(time.monotonic()))
    took = time.monotonic() - began
    assert took > 3 * SAVE_PROGRESS_POLL_S, f"the save should be slow here ({took:.1f} s)"
    gaps = [b - a for a, b in zip([began, *beats], beats)]
    assert len(beats) >= 3 and max(gaps) <= SAVE_PROGRESS_POLL_S + FSYNC_S + SLACK_S, (took, gaps)
    assert read_tracker(tmp_path / "save") == 3


def test_a_save_without_progress_beats_nothing(tmp_path: Path) -> None:
    beats: list[float] = []

    def stuck(folder: Path) -> None:
        time.sleep(3 * SAVE_PROGRESS_POLL_S)  # a writer stuck on a dead filesystem
        (folder / "common.pt").write_bytes(b"x")

    began = time.monotonic()
    checkpoint.save(tmp_path / "save", 1, stuck, progress=lambda: beats.append(time.monotonic()))
    assert not [b for b in beats if b < began + 3 * SAVE_PROGRESS_POLL_S], beats


def test_a_phase_keeps_its_start_across_beats(tmp_path: Path) -> None:
    """The supervisor judges a save under way by when it began (supervisor/deadline.py)."""
    job_dir = JobDir(tmp_path / "job")
    reporter = Reporter(job_dir, str(tmp_path / "tb"))
    try:
        reporter.heartbeat(Phase.SAVE, 4)
        first = read_heartbeat(job_dir, 0.0)
        time.sleep(0.05)
        reporter.heartbeat(Phase.SAVE, 4)  # the save's progress
        again = read_heartbeat(job_dir, 0.0)
        assert again.time > first.time and again.since == first.since == first.began
        reporter.heartbeat(Phase.ROLLOUT, 5)
        assert read_heartbeat(job_dir, 0.0).began > first.began
    finally:
        reporter.close()
