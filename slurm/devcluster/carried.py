"""SLURM and munge run from carried Debian packages, where apt-get reaches no registry (the GPU
machine): scripts/fetch_slurm_debs.sh downloads the .deb files where apt works; here each is
unpacked with `dpkg -x` into one prefix (not into /), and the daemons and SLURM's programs run from
there. Seen working with Debian 12's SLURM 22.05 on Ubuntu 24.04 (reference/slurm-devcluster.md).

What unpacked packages lack, installed ones have: update-alternatives' links (Debian names the
daemons slurmd-wlm, slurmctld-wlm, slurmstepd-wlm), and the library path baked into the programs
(/usr/lib/<triplet>/slurm-wlm): LD_LIBRARY_PATH and slurm.conf's PluginDir name the prefix's. The
links are made in the prefix, and the daemons run by them: SLURM knows which daemon it is by its
program name (run as slurmctld-wlm, slurmctld drops every node's Gres=gpu:N: seen). slurmd runs
/usr/sbin/slurmstepd, a path built in: that one link is made on the machine itself.
"""

from __future__ import annotations

import filecmp
import os
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from slurm.devcluster.daemons import DevclusterError
from slurm.devcluster.host import Host

# Debian's names of the daemons that update-alternatives would link to their plain names.
_WLM_NAMES = {"slurmd": "slurmd-wlm", "slurmctld": "slurmctld-wlm", "slurmstepd": "slurmstepd-wlm"}
_NEEDED = ("usr/sbin/munged", "usr/sbin/slurmd-wlm", "usr/sbin/slurmctld-wlm", "usr/sbin/slurmstepd-wlm",
           "usr/bin/sbatch", "usr/bin/srun", "usr/bin/squeue", "usr/bin/scontrol", "usr/bin/sinfo", "usr/bin/scancel")
_STAMP = ".unpacked"  # the .deb files (name and size) the prefix was unpacked from
DPKG_S = 120.0  # one `dpkg -x` (a few MB)


@dataclass(frozen=True)
class SlurmPrograms:
    """Where the devcluster's daemons and SLURM's programs are: on PATH (installed), or under
    `prefix` (unpacked carried packages)."""

    prefix: Path | None = None

    def daemon(self, name: str) -> str:
        """munged, slurmctld, slurmd...: the program to run."""
        return name if self.prefix is None else str(self.prefix / "usr" / "sbin" / name)

    @property
    def plugin_dir(self) -> Path | None:
        return None if self.prefix is None else _slurm_lib(self.prefix)

    def prepended(self) -> dict[str, str]:
        """PATH and LD_LIBRARY_PATH's first entries: the prefix's programs and libraries ({} when installed)."""
        if self.prefix is None:
            return {}
        slurm_lib = _slurm_lib(self.prefix)
        # Debian 12 still puts some libraries under /lib (libdbus-1, which the cgroup/v2 plugin needs)
        libs = [self.prefix / "lib" / slurm_lib.parent.name, slurm_lib.parent, slurm_lib]
        return {"PATH": str(self.prefix / "usr" / "bin"), "LD_LIBRARY_PATH": os.pathsep.join(map(str, libs))}

    def env(self, base: Mapping[str, str] = os.environ) -> dict[str, str]:
        """PATH and LD_LIBRARY_PATH for the daemons and SLURM's programs: the prefix's, then `base`'s."""
        defaults = {"PATH": os.defpath, "LD_LIBRARY_PATH": ""}
        return {name: _joined(first, base.get(name, defaults[name])) for name, first in self.prepended().items()}


def unpacked(prefix: Path) -> bool:
    """Whether `prefix` holds every package of a complete unpack."""
    return (prefix / _STAMP).is_file()


def unpack(debs: Path, prefix: Path, in_use: bool) -> None:
    """Unpack every .deb in `debs` into `prefix` (again only when the files changed; never under
    daemons that run from it: in_use). DevclusterError with the fix when something is missing."""
    files = sorted(debs.glob("*.deb"))
    if not files:
        raise DevclusterError(f"--debs {debs}: no .deb files there; fetch them with "
                              f"`bash scripts/fetch_slurm_debs.sh {debs}` where apt-get works")
    listing = "".join(f"{f.name} {f.stat().st_size}\n" for f in files)
    stamp = prefix / _STAMP
    if stamp.is_file() and stamp.read_text() == listing:
        return
    if in_use:
        raise DevclusterError(f"the .deb files in {debs} changed while the devcluster runs from them; "
                              "run `slurmrl cluster down` first")
    if prefix.exists():
        subprocess.run(["rm", "-rf", "--one-file-system", str(prefix)], check=True, timeout=DPKG_S)
    prefix.mkdir(parents=True)
    for deb in files:
        try:
            done = subprocess.run(["dpkg", "-x", str(deb), str(prefix)], capture_output=True, text=True,
                                  timeout=DPKG_S)
        except FileNotFoundError:
            raise DevclusterError("--debs needs dpkg to unpack the packages, and there is none here") from None
        if done.returncode != 0:
            raise DevclusterError(f"`dpkg -x {deb}` failed ({done.returncode}): {done.stderr.strip()[-500:]}")
    missing = [path for path in _NEEDED if not (prefix / path).exists()]
    if missing or not list(prefix.glob("usr/lib/*/slurm-wlm")):
        raise DevclusterError(f"--debs {debs}: the packages hold no {', '.join(missing) or 'usr/lib/*/slurm-wlm'}; "
                              f"fetch them all with `bash scripts/fetch_slurm_debs.sh {debs}`")
    for name, wlm in _WLM_NAMES.items():  # what update-alternatives would link
        (prefix / "usr" / "sbin" / name).symlink_to(wlm)
    stamp.write_text(listing)


def link_stepd(prefix: Path, host: Host) -> None:
    """Make host's /usr/sbin/slurmstepd the prefix's slurmstepd-wlm. Kept: the same program already
    there (these packages installed). Replaced: a link into another unpacked prefix, or one whose
    target is gone. Refused: another SLURM's slurmstepd (slurmd would run a stranger's)."""
    ours, stepd = prefix / "usr" / "sbin" / "slurmstepd", host.stepd
    if stepd.exists() and filecmp.cmp(stepd, ours, shallow=False):
        return
    carried = stepd.is_symlink() and os.readlink(stepd).endswith("/prefix/usr/sbin/slurmstepd")
    if stepd.exists() and not carried:
        raise DevclusterError(f"{stepd} is another SLURM's slurmstepd, and slurmd of the carried packages runs "
                              f"that path: remove it, or bring the cluster up without --debs")
    stepd.unlink(missing_ok=True)
    stepd.parent.mkdir(parents=True, exist_ok=True)
    stepd.symlink_to(ours)


def env_script(slurm_conf: Path, programs: SlurmPrograms) -> str:
    """Shell lines that point a shell at the cluster: SLURM_CONF, and the prefix's programs first."""
    lines = [f"export SLURM_CONF={slurm_conf}"]
    lines += [f"export {name}={first}${{{name}:+:${name}}}" for name, first in programs.prepended().items()]
    return "\n".join(lines) + "\n"


def _slurm_lib(prefix: Path) -> Path:
    """<prefix>/usr/lib/<triplet>/slurm-wlm: libslurmfull.so and the plugins."""
    found = sorted(prefix.glob("usr/lib/*/slurm-wlm"))
    if not found:
        raise DevclusterError(f"{prefix} holds no usr/lib/*/slurm-wlm: unpack the carried packages again (--debs)")
    return found[0]


def _joined(first: str, rest: str) -> str:
    return f"{first}{os.pathsep}{rest}" if rest else first
