"""Stopping a devcluster daemon from another process than the one that started it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import psutil

from slurm.devcluster.daemons import Daemon


def test_stop_from_another_process_returns_while_the_starter_has_not_reaped_it(tmp_path: Path) -> None:
    # As in CI: a test revives a slurmd (so the test process is its parent and never reaps it),
    # then `devcluster down` stops it from a separate process, which sees only a zombie.
    daemon = Daemon("sleeper", ["sleep", "300"], tmp_path / "sleeper.pid", tmp_path / "sleeper.log")
    daemon.start()
    proc = daemon.process()
    assert proc is not None
    stopper = (f"from pathlib import Path; from slurm.devcluster.daemons import Daemon; "
               f"print(Daemon('sleeper', [], Path({str(daemon.pid_file)!r}), Path({str(daemon.log_file)!r})).stop())")
    result = subprocess.run([sys.executable, "-c", stopper], capture_output=True, text=True, timeout=60)
    try:
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == "True"
        assert proc.status() == psutil.STATUS_ZOMBIE and not daemon.pid_file.exists()
    finally:
        if proc.is_running():
            proc.kill()
        proc.wait(timeout=10)  # reaps it: this test process is its parent
