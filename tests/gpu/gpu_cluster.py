"""A SLURM devcluster over this machine's real GPUs, for the GPU job tests (tests/gpu/test_gpu_job.py)
and scripts/gpu_job.sh's twin: one emulated node per GPU (its /dev/nvidiaK as gres: a step bound to
it sees it as cuda:0), SLURM and munge from the carried .deb files where the machine has no SLURM of
its own, no accounting (nothing here asks sacct), every node on 127.0.0.1 (NCCL between the
trainer's and the engines' steps goes over loopback, as on one box). Its own --dir, ports and node
names: it never meets the CPU suite's clusters.

The fixture skips, saying why, without CUDA or without a SLURM to run; a test asks for the GPUs it
needs with needs_gpus(n), which skips where the machine has fewer.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
ROOT = Path(os.environ.get("SLURMRL_GPU_DEVCLUSTER_DIR", "/tmp/slurmrl-gpucluster"))
DEBS = Path(os.environ.get("SLURMRL_DEBS", REPO / ".debs"))  # scripts/fetch_slurm_debs.sh's folder
PORT_BASE = 16400  # below the CPU suite's clusters (17800, and 100 less per xdist worker)
NODE_PREFIX = "gpu"  # nodes gpu1..gpuN, node K holding /dev/nvidia(K-1)
UP_TIMEOUT_S = 600  # unpacking the packages, starting munge, slurmctld and one slurmd per GPU
SLURM_CALL_S = 60  # one SLURM program call (squeue, scancel)


def gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def needs_gpus(n: int) -> pytest.MarkDecorator:
    have = gpu_count()
    return pytest.mark.skipif(have < n, reason=f"needs {n} CUDA GPUs, torch sees {have}")


def up_argv(gpus: int) -> list[str]:
    """`python -m slurm.devcluster up` for a cluster of one node per GPU (ClusterShape's flags)."""
    argv = [sys.executable, "-m", "slurm.devcluster", "up", "--dir", str(ROOT), "--gpus", "real",
            "--nodes", str(gpus), "--gpus-per-node", "1", "--shared-loopback", "--no-accounting",
            "--port-base", str(PORT_BASE), "--node-prefix", NODE_PREFIX]
    if shutil.which("slurmctld") is None:
        argv += ["--debs", str(DEBS)]
    return argv


def client_env(root: Path) -> dict[str, str]:
    """The variables <root>/env.sh sets (SLURM_CONF; PATH and LD_LIBRARY_PATH of the unpacked SLURM)."""
    out = subprocess.run(["bash", "-c", f'source "{root}/env.sh" && python3 -c "import json, os; '
                          'print(json.dumps(dict(os.environ)))"'], capture_output=True, text=True, check=True,
                         timeout=SLURM_CALL_S)
    after = json.loads(out.stdout)
    return {k: v for k, v in after.items() if k in ("SLURM_CONF", "PATH", "LD_LIBRARY_PATH") and v != os.environ.get(k)}


@pytest.fixture(scope="session")
def gpu_cluster() -> Iterator[Path]:
    """The cluster's root, with this process's environment pointing SLURM's programs at it (and
    restored after the session); brought down at the end if this session brought it up."""
    gpus = gpu_count()
    if gpus == 0:
        pytest.skip("needs CUDA: torch sees no GPU")
    if shutil.which("slurmctld") is None and not any(DEBS.glob("*.deb")):
        pytest.skip(f"no SLURM here: no slurmctld on PATH and no carried .deb files in {DEBS} "
                    "(bash scripts/fetch_slurm_debs.sh where apt works, then carry .debs)")
    up = subprocess.run(up_argv(gpus), capture_output=True, text=True, timeout=UP_TIMEOUT_S, cwd=REPO)
    if up.returncode != 0:
        pytest.fail(f"the GPU devcluster did not come up ({' '.join(up_argv(gpus)[1:])}):\n{up.stdout}{up.stderr}")
    saved = dict(os.environ)
    os.environ.update(client_env(ROOT))
    try:
        yield ROOT
    finally:
        subprocess.run([sys.executable, "-m", "slurm.devcluster", "down", "--dir", str(ROOT)], cwd=REPO,
                       capture_output=True, timeout=UP_TIMEOUT_S)
        os.environ.clear()
        os.environ.update(saved)


def engine_pid(url: str) -> int:
    """The pid of the engine serving `url`, found without `ss` (the GPU machine may lack iproute2):
    the Python process whose command line runs rollout.cpu_engine with `--port N` (the step's
    `python -m supervisor.with_key rollout.cpu_engine ...`; srun's and wrappers' command lines hold
    the same words) and starts no other such process."""
    port = url.rsplit(":", 1)[1]
    found = set()
    for proc in psutil.process_iter(["cmdline"]):
        argv = proc.info["cmdline"] or []
        if (argv and os.path.basename(argv[0]).startswith("python") and "rollout.cpu_engine" in argv
                and "--port" in argv and argv[argv.index("--port") + 1] == port):
            found.add(proc.pid)
    leaves = [pid for pid in found if not found & {c.pid for c in psutil.Process(pid).children(recursive=True)}]
    assert len(leaves) == 1, f"expected one engine on port {port}, found {sorted(found)}"
    return leaves[0]


def visible_gpus(pid: int) -> str:
    """The CUDA_VISIBLE_DEVICES a step's process runs with (SLURM's binding, mapped to the machine's
    device numbers by the devcluster's TaskProlog)."""
    return psutil.Process(pid).environ().get("CUDA_VISIBLE_DEVICES", "")
