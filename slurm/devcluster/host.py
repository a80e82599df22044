"""The machine under the devcluster: where it keeps its device files, its cgroup tree and the
slurmstepd that slurmd runs. One value, so tests hand in a fake tree and run on any machine."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Host:
    dev: Path = Path("/dev")  # where /dev/nvidia0... are looked for
    cgroup: Path = Path("/sys/fs/cgroup")
    sbin: Path = Path("/usr/sbin")  # slurmd execs <this>/slurmstepd, a path built into Debian's slurmd

    @property
    def cgroup_v2(self) -> bool:
        """A unified (v2) cgroup hierarchy is mounted (a v1 mount has one folder per controller instead)."""
        return (self.cgroup / "cgroup.controllers").exists()

    @property
    def stepd(self) -> Path:
        return self.sbin / "slurmstepd"


def render_cgroup_conf(cgroup_v2: bool) -> str:
    """slurmd loads a cgroup plugin even with proctrack/linuxproc and task/none. Under cgroup v2 it
    asks systemd (over dbus) for a scope by default, which fails where there is no systemd (the GPU
    machine: "Unable to initialize cgroup plugin"): IgnoreSystemd makes it use
    <cgroup>/system.slice itself, which must exist (DevCluster creates it)."""
    if not cgroup_v2:
        return "# cgroup v1 here: SLURM's defaults. Generated.\n"
    return ("# cgroup v2: slurmd makes its own scope under system.slice, without systemd. Generated.\n"
            "CgroupPlugin=cgroup/v2\nIgnoreSystemd=yes\n")
