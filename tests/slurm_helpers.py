"""Small helpers the integration tests use to drive the devcluster through SLURM's own commands."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path
from urllib.parse import urlsplit

import psutil

from slurm.devcluster import DevCluster, netns
from slurm.devcluster.daemons import wait_for


def slurm(*argv: str) -> str:
    """Run a SLURM command; its stdout, or an assertion error carrying its stderr."""
    result = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, f"{' '.join(argv)} failed: {result.stderr}"
    return result.stdout


def sbatch(script: Path) -> str:
    return slurm("sbatch", "--parsable", str(script)).strip().split(";")[0]


def job_in_queue(job_id: str) -> bool:
    return bool(slurm("squeue", "-h", "-j", job_id, "-o", "%i").strip())


def wait_job_gone(job_id: str, timeout_s: float = 120) -> None:
    wait_for(lambda: not job_in_queue(job_id), timeout_s, f"job {job_id} to leave the queue", interval_s=0.5)


def wait_file_contains(path: Path, text: str, timeout_s: float = 120) -> None:
    wait_for(lambda: path.exists() and text in path.read_text(), timeout_s, f"{text!r} in {path}", interval_s=0.3)


def sacct_rows(job_id: str, *fields: str, duplicates: bool = False) -> list[dict[str, str]]:
    """Accounting records of a job's allocations (not its steps), oldest first."""
    argv = ["sacct", "-n", "-P", "-j", job_id, "-o", ",".join(("JobID", *fields))] + (["-D"] if duplicates else [])
    rows = [line.split("|") for line in slurm(*argv).splitlines() if line]
    # sacct -X would fold a hetjob's components into one row: drop the step rows instead.
    return [dict(zip(fields, row[1:])) for row in rows if "." not in row[0]]


def write_script(path: Path, body: str) -> Path:
    path.write_text("#!/bin/bash\n" + body.lstrip())
    return path


def wait_sacct_states(job_id: str, expected: dict[str, str] | list[str], duplicates: bool = False,
                      timeout_s: float = 30) -> None:
    """slurmdbd records a job's end a moment after it leaves the queue: wait for the states."""
    def states() -> dict[str, str] | list[str]:
        rows = sacct_rows(job_id, "JobID", "State", duplicates=duplicates)
        if isinstance(expected, dict):
            return {r["JobID"]: r["State"] for r in rows}
        return [r["State"] for r in rows]

    try:
        wait_for(lambda: states() == expected, timeout_s, f"sacct to show {expected} for job {job_id}")
    except TimeoutError as err:
        raise AssertionError(f"{err}; it shows {states()}") from None


def kill_node(cluster: DevCluster, node: str, step_pid: int) -> None:
    """The node dies: its slurmd, and the slurmstepd of the step `step_pid` runs in with everything
    below it (on a devcluster every node is this host, so they would outlive their slurmd)."""
    stepd = next(p for p in psutil.Process(step_pid).parents()
                 if p.cmdline()[:1] and p.cmdline()[0].startswith("slurmstepd"))
    doomed = [stepd, *stepd.children(recursive=True)]
    cluster.kill_slurmd(node)
    for proc in doomed:
        proc.kill()


def listening_pids(url: str) -> set[int]:
    """The processes listening on url's port, looked up in the network namespace of the node whose
    address url has (the host's own where nodes share loopback): `ss` there names their pids."""
    parts = urlsplit(url)
    out = subprocess.run([*_netns_of(parts.hostname), "ss", "-Hltnp", f"sport = :{parts.port}"],
                         capture_output=True, text=True, timeout=30, check=True).stdout
    return {int(pid) for pid in re.findall(r"pid=(\d+)", out)}


def listening_pid(url: str) -> int:
    """The one process listening on url's port."""
    pids = listening_pids(url)
    assert len(pids) == 1, f"expected one process listening on {urlsplit(url).port}, found {pids}"
    return pids.pop()


def _netns_of(host: str | None) -> list[str]:
    """The argv prefix that enters the namespace of the devcluster node at `host` (SLURM_CONF's
    cluster); none for an address of the host's own."""
    plan = netns.load_plan(Path(os.environ["SLURM_CONF"]).parent.parent)
    for node in plan.nodes if plan else ():
        if plan.node_addr(node) == host:
            return plan.enter(node)
    return []
