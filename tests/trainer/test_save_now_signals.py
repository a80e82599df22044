"""A C handler set over Python's for SIGUSR1 (Triton's LLVM does it when torch.compile builds its first
GPU kernel, and never passes the signal on) must not lose the supervisor's save-now: the loop takes the
signals again before each rollout and after each train step (trainer.save_now.StopRequests). A child
process sets SIG_IGN through libc, behind Python's back, as LLVM sets its own handler."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHILD_S = 60  # bound on the child's run (about a second)

_TRAINER = textwrap.dedent("""
    import ctypes, json, os, signal, time
    from trainer import save_now
    from trainer.save_now import StopRequests

    def usr1_reaches_it(signal_state) -> bool:
        os.kill(os.getpid(), signal.SIGUSR1)
        deadline = time.monotonic() + 1  # a signal to itself is handled before os.kill returns
        while not signal_state.requested and time.monotonic() < deadline:
            time.sleep(0.01)
        reached, signal_state.requested = signal_state.requested, False
        return reached

    state = save_now.install()
    libc = ctypes.CDLL(None)
    libc.signal.argtypes, libc.signal.restype = [ctypes.c_int, ctypes.c_void_p], ctypes.c_void_p
    stops = StopRequests(state, None, lambda value: value, lambda profile: None)
    seen = {}
    for point, take_again in (("before_rollout", stops.before_rollout), ("after_train", stops.after_train)):
        libc.signal(signal.SIGUSR1, 1)  # SIG_IGN, set in C: Python still reports its own handler
        seen[point] = {"displaced": not usr1_reaches_it(state)}
        take_again(0) if point == "before_rollout" else take_again()
        seen[point]["taken_again"] = usr1_reaches_it(state)
    print(json.dumps(seen))
""")


def test_the_loop_takes_the_save_now_signal_back_from_a_library_that_took_it() -> None:
    done = subprocess.run([sys.executable, "-c", _TRAINER], cwd=REPO, timeout=CHILD_S, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": REPO})
    assert done.returncode == 0, done.stderr[-2000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    for point in ("before_rollout", "after_train"):
        assert seen[point]["displaced"], f"{point}: the C handler did not take SIGUSR1 (the test proves nothing)"
        assert seen[point]["taken_again"], f"{point}: the save-now signal is still lost"
