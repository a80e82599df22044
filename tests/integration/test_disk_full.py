"""A full disk under --save in the toy job on the devcluster (a real 256 KiB tmpfs as the save
folder): the trainer's first save is refused with the folder, the free space and the checkpoint's
size; the supervisor fails the job with that reason at once instead of restarting the trainer into
the same save (it used to spend three restarts on "unexpected pos 704 vs 598"), and no partial
checkpoint folder is left."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from tests.integration.test_rl_job import events, status, submit
from tests.slurm_helpers import wait_job_gone


def test_a_full_save_disk_fails_the_job_with_the_reason_and_no_restart(devcluster, toy, tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(disk)], check=True)
    job_id = None
    try:
        job_dir = tmp_path / "job"
        job_id = submit(toy, job_dir, "--num-rollout", "3", "--save-interval", "1", "--save", str(disk / "ckpt"))
        wait_job_gone(job_id, timeout_s=240)
        state = status(job_dir)
        assert re.fullmatch(rf"failed: no space left on {disk / 'ckpt'} \(\d+ MiB free, checkpoint needs ~\d+ MiB\).*",
                            state["stop_reason"]), state["stop_reason"]
        assert state["steps"]["trainer"]["restarts"] == 0, "no restart into a certain failure"
        assert [e["fatal"] for e in events(job_dir, "trainer_failed")] == [True]
        assert not list((disk / "ckpt").glob(".iter_*")), "no partial checkpoint folder is left"
        assert not list((disk / "ckpt").glob("iter_*"))
    finally:
        if job_id is not None:
            subprocess.run(["scancel", job_id], capture_output=True)
        subprocess.run(["umount", "--lazy", str(disk)], check=True)
