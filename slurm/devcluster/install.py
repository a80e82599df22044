"""SLURM, munge and MariaDB installed from Debian's packages with apt-get, when missing. (Where
apt-get reaches no registry, `--debs` runs them from carried packages instead: carried.py.)"""

from __future__ import annotations

import os
import shutil
import subprocess

from slurm.devcluster.daemons import DevclusterError, machine_lock

APT_PACKAGES = ["slurm-wlm", "slurmdbd", "munge", "mariadb-server", "mariadb-client"]
SLURM_PROGRAMS = ["munged", "slurmctld", "slurmd", "sbatch", "srun", "sacct", "sinfo", "scontrol", "scancel", "squeue"]
ACCOUNTING_PROGRAMS = ["mariadbd", "mariadb-install-db", "mariadb", "slurmdbd", "sacctmgr"]
REQUIRED_PROGRAMS = SLURM_PROGRAMS + ACCOUNTING_PROGRAMS
APT_GET_S = 900.0  # apt-get update, or installing the packages


def ensure_installed(accounting: bool = True) -> None:
    """apt-get install SLURM, munge and MariaDB if any program the cluster runs is missing. One
    caller at a time (apt-get refuses a second while one runs): the next finds them installed."""
    needed = REQUIRED_PROGRAMS if accounting else SLURM_PROGRAMS
    if all(shutil.which(p) for p in needed):
        return
    with machine_lock("install"):
        if not all(shutil.which(p) for p in needed):  # else another caller installed them meanwhile
            _apt_get_install()
    missing = [p for p in needed if not shutil.which(p)]
    if missing:
        raise DevclusterError(f"installed {' '.join(APT_PACKAGES)} but still missing: {', '.join(missing)}")


def _apt_get_install() -> None:
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for argv in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", *APT_PACKAGES]):
        try:
            result = subprocess.run(argv, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                                    timeout=APT_GET_S)
        except (FileNotFoundError, subprocess.TimeoutExpired) as err:
            raise DevclusterError(f"`{' '.join(argv)}` could not run ({err}); {_CARRY}") from None
        if result.returncode != 0:
            raise DevclusterError(f"`{' '.join(argv)}` failed ({result.returncode}); {_CARRY}:\n"
                                  f"{result.stderr[-2000:]}")


_CARRY = ("where apt-get reaches no registry, carry the packages: `bash scripts/fetch_slurm_debs.sh` on a "
          "machine where it does, then `slurmrl cluster up --debs .debs --no-accounting`")
