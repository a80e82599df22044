"""The supervisor's save-now signal (SIGUSR1) reaching a trainer that saved and is exiting must not
end it with code 138 (issue 29, item 5): Python gives SIGUSR1 its default action back as it shuts
down, before the last finalizers run (torch's teardown takes a while); the trainer ignores the
signal from its exit on. A child Python process stands in for the exiting trainer: a finalizer
that runs after Python's signal teardown holds it while the signal arrives."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHILD_S = 30  # bound on the child's run (it takes about a second)

_EXITING_TRAINER = textwrap.dedent("""
    import gc, os, subprocess, sys, time
    if sys.argv[1] == "install":
        from trainer import save_now
        save_now.install()
    else:  # a Python handler, as save_now installs, without the exit's ignore
        import signal
        signal.signal(signal.SIGUSR1, lambda *a: None)

    class Teardown:  # collected after the signal teardown, as torch's objects are
        def __del__(self):
            time.sleep(1.5)

    gc.disable()  # the cycle waits for the collection at exit
    slow = Teardown()
    slow.me = slow
    del slow
    # The supervisor's signal, 0.5 s into the teardown.
    subprocess.Popen(["sh", "-c", f"sleep 0.5; kill -USR1 {os.getpid()}"])
""")


def _exit_code(mode: str) -> int:
    return subprocess.run([sys.executable, "-c", _EXITING_TRAINER, mode], cwd=REPO, timeout=CHILD_S,
                          env={**os.environ, "PYTHONPATH": REPO}).returncode


def test_the_save_now_signal_does_not_end_an_exiting_trainer() -> None:
    assert _exit_code("install") == 0
    # What it guards against: without the ignore, the same signal ends the process as it exits.
    assert _exit_code("handler only") == -signal.SIGUSR1
