"""--custom-rm-path tests.trainer.slow_save_disk.toy_reward: the toy reward, in a trainer whose
checkpoint folder is on a slow disk. Importing the plug-in (rank 0 does, as it starts) slows that
process's os.fsync of every file under JOB_DIR/checkpoints by $SLURMRL_TEST_FSYNC_S seconds (unset:
no delay); torch's checkpoint writers and slurmrl's own fsync through it."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from contract.job_dir import JOB_DIR_ENV
from rollout.rewards import toy_reward as _toy_reward

DELAY_ENV = "SLURMRL_TEST_FSYNC_S"


def toy_reward(args: Any, sample: Any) -> float:
    return _toy_reward(sample.response, sample.label)


def _slowed(fsync: Callable[[int], None]) -> Callable[[int], None]:
    delay = float(os.environ.get(DELAY_ENV) or 0)
    folder = os.path.realpath(os.path.join(os.environ.get(JOB_DIR_ENV, "/nonexistent"), "checkpoints"))

    def slow_fsync(fd: int) -> None:
        if delay and os.readlink(f"/proc/self/fd/{fd}").startswith(folder + os.sep):
            time.sleep(delay)
        fsync(fd)
    return slow_fsync


os.fsync = _slowed(os.fsync)
