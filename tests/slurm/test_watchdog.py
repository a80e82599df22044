"""The batch step's watchdog: a child killed by a signal is started again (a bounded number of
times), an exception or an exit is final, SLURM's signals reach the child, and SIGTERM (the job
ending) is never answered with a restart."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from slurm.devcluster.daemons import wait_for

ROOT = Path(__file__).resolve().parents[2]

# The child's behaviour by mode; RUNS collects the watchdog restart count each run saw.
CHILD = """
import os, signal, sys, time
from pathlib import Path
from slurm.watchdog import watch_self

code = watch_self()
if code is not None:
    sys.exit(code)
runs, mode = Path(sys.argv[1]), sys.argv[2]
with open(runs, "a") as f:
    f.write(os.environ["SLURMRL_SUPERVISOR_RESTARTS"] + " ")
assert "SLURMRL_SUPERVISOR_CHILD" not in os.environ  # not passed on to what the child starts
if mode == "crash-once" and runs.read_text() == "0 ":
    os.kill(os.getpid(), signal.SIGKILL)
if mode == "always-crash":
    os.kill(os.getpid(), signal.SIGKILL)
if mode == "raise":
    raise RuntimeError("a Python error is the job's result, not a crash")
if mode in ("signals", "term"):
    got = []
    for sig in (signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, lambda s, f: got.append(signal.Signals(s).name))
    (runs.parent / "ready").touch()
    while len(got) < 2:
        time.sleep(0.05)  # in "term" mode SIGTERM (default action) ends it first
    (runs.parent / "got").write_text(" ".join(got))
sys.exit(3)
"""


def start(tmp_path: Path, mode: str) -> subprocess.Popen[str]:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("SLURMRL_SUPERVISOR_CHILD", None)
    return subprocess.Popen([sys.executable, str(script), str(tmp_path / "runs"), mode], env=env, cwd=ROOT,
                            stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen[str]) -> tuple[int, str]:
    _, err = proc.communicate(timeout=60)
    return proc.returncode, err


@pytest.mark.parametrize(("mode", "code", "runs"), [
    ("crash-once", 3, "0 1 "),  # SIGKILLed: started again, then its own exit code
    ("always-crash", 128 + signal.SIGKILL, "0 1 2 3 "),  # three restarts, then 128 + the signal
    ("raise", 1, "0 "),  # an exception is final
])
def test_a_crash_restarts_the_child_an_exit_does_not(tmp_path: Path, mode: str, code: int, runs: str) -> None:
    rc, err = finish(start(tmp_path, mode))
    assert (rc, (tmp_path / "runs").read_text()) == (code, runs), err
    restarts = [line for line in err.splitlines() if "slurmrl watchdog: supervisor_crashed signal=SIGKILL" in line]
    assert len(restarts) == len(runs.split()) - 1, err


def test_signals_reach_the_child(tmp_path: Path) -> None:
    proc = start(tmp_path, "signals")
    wait_for(lambda: (tmp_path / "ready").exists(), 30, "the child to install its handlers")
    proc.send_signal(signal.SIGUSR1)
    proc.send_signal(signal.SIGUSR2)
    rc, err = finish(proc)
    assert rc == 3, err
    assert sorted((tmp_path / "got").read_text().split()) == ["SIGUSR1", "SIGUSR2"]


def test_sigterm_ends_the_child_for_good(tmp_path: Path) -> None:
    proc = start(tmp_path, "term")
    wait_for(lambda: (tmp_path / "ready").exists(), 30, "the child to install its handlers")
    proc.send_signal(signal.SIGTERM)  # as SLURM ends a job: not a crash to recover from
    rc, err = finish(proc)
    assert (rc, (tmp_path / "runs").read_text()) == (128 + signal.SIGTERM, "0 "), err
    assert "supervisor_crashed" not in err
