"""The devcluster's layout on disk, its ports, and the config files it renders.

Everything lives under one root directory; nothing is written to /etc, /run or /var.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from slurm.devcluster.gpus import FAKE, REAL

DEFAULT_ROOT = Path(os.environ.get("SLURMRL_DEVCLUSTER_DIR", "/tmp/slurmrl-devcluster"))
CLUSTER_NAME = "slurmrl-dev"
PARTITION = "dev"
ACCOUNTING_DB = "slurmrl_acct_db"
# Ports above the well-known range and clear of SLURM's own defaults (6817-6819), so the
# devcluster can run beside a real SLURM or MariaDB.
DEFAULT_PORT_BASE = 17800
MAX_NODES = 64
# How long a requeued job is held before it may start again (SLURM's cred_expire, default
# 120 s). Short, so that preemption and requeue tests do not idle for minutes.
CRED_EXPIRE_S = 10


@dataclass(frozen=True)
class ClusterShape:
    """What the user chose: node count and resources per node."""

    nodes: int = 4  # the toy job's 1 trainer and 2 rollout nodes, and a spare rollout node
    gpus_per_node: int = 4
    cpus_per_node: int = 8
    memory_mb_per_node: int = 16384
    port_base: int = DEFAULT_PORT_BASE
    isolated: bool = True  # one network namespace per node (netns.py); else every node is 127.0.0.1
    node_prefix: str = "node"  # nodes are <prefix>1..<prefix>N (two isolated clusters need two prefixes)
    gpus: str = FAKE  # REAL: the machine's /dev/nvidia* as gres, a slice per node (gpus.py); FAKE: placeholders
    accounting: bool = True  # MariaDB and slurmdbd, for sacct; else accounting_storage/none
    debs: str = ""  # a folder of carried .deb files to run SLURM and munge from (carried.py); "": the installed ones

    def validate(self) -> None:
        if not 1 <= self.nodes <= MAX_NODES:
            raise ValueError(f"--nodes must be between 1 and {MAX_NODES}, got {self.nodes}")
        if self.gpus_per_node < 0:
            raise ValueError(f"--gpus-per-node must be 0 or more, got {self.gpus_per_node}")
        if self.cpus_per_node < 1:
            raise ValueError(f"--cpus-per-node must be 1 or more, got {self.cpus_per_node}")
        if not re.fullmatch(r"[a-z][a-z-]{0,15}", self.node_prefix):
            raise ValueError(f"--node-prefix must be 1 to 16 lowercase letters or '-', starting with a letter, "
                             f"got {self.node_prefix!r}")
        if not 1024 <= self.port_base <= 65535 - (20 + MAX_NODES):
            raise ValueError(f"--port-base must be between 1024 and {65535 - 20 - MAX_NODES}, got {self.port_base}")
        if self.gpus not in (REAL, FAKE):
            raise ValueError(f"--gpus must be auto, real or fake, got {self.gpus!r}")
        if self.debs and self.accounting:
            raise ValueError(f"--debs {self.debs}: the carried packages hold no slurmdbd or MariaDB; "
                             "add --no-accounting")
        if self.debs and not Path(self.debs).is_dir():
            raise ValueError(f"--debs {self.debs}: no such folder; fetch the packages into it with "
                             f"`bash scripts/fetch_slurm_debs.sh {self.debs}` where apt-get works")

    @property
    def node_names(self) -> list[str]:
        return [f"{self.node_prefix}{k}" for k in range(1, self.nodes + 1)]

    @property
    def mariadb_port(self) -> int:
        return self.port_base + 6

    @property
    def slurmctld_port(self) -> int:
        return self.port_base + 17

    @property
    def slurmdbd_port(self) -> int:
        return self.port_base + 19

    def slurmd_port(self, node_index: int) -> int:
        """Port of node `node_index` (1-based)."""
        return self.port_base + 20 + node_index

    def all_ports(self) -> dict[str, int]:
        ports = {"mariadb": self.mariadb_port, "slurmdbd": self.slurmdbd_port} if self.accounting else {}
        ports["slurmctld"] = self.slurmctld_port
        ports.update({f"slurmd-{n}": self.slurmd_port(k) for k, n in enumerate(self.node_names, 1)})
        return ports


@dataclass(frozen=True)
class ClusterPaths:
    """Where each file of a devcluster rooted at `root` lives."""

    root: Path

    @property
    def etc(self) -> Path:
        return self.root / "etc"

    @property
    def slurm_conf(self) -> Path:
        return self.etc / "slurm.conf"

    @property
    def slurmdbd_conf(self) -> Path:
        # slurmdbd reads slurmdbd.conf from the directory of SLURM_CONF.
        return self.etc / "slurmdbd.conf"

    @property
    def gres_conf(self) -> Path:
        return self.etc / "gres.conf"

    @property
    def shape_file(self) -> Path:
        return self.root / "cluster.json"

    @property
    def db_password_file(self) -> Path:
        return self.etc / "db-password"

    @property
    def munge_key(self) -> Path:
        return self.etc / "munge.key"

    @property
    def munge_socket(self) -> Path:
        return self.root / "munge" / "munge.socket"

    @property
    def mariadb_data(self) -> Path:
        return self.root / "mariadb" / "data"

    @property
    def mariadb_socket(self) -> Path:
        return self.root / "mariadb" / "run" / "mysqld.sock"

    @property
    def state(self) -> Path:
        return self.root / "state"

    @property
    def logs(self) -> Path:
        return self.root / "log"

    @property
    def pids(self) -> Path:
        """PID files written by the devcluster for every daemon it started."""
        return self.root / "pids"

    @property
    def slurm_run(self) -> Path:
        """PID files SLURM's daemons write themselves."""
        return self.root / "run"

    @property
    def cgroup_conf(self) -> Path:
        return self.etc / "cgroup.conf"

    @property
    def gpu_task_prolog(self) -> Path:
        """With real GPUs: maps each task's CUDA_VISIBLE_DEVICES to this machine's devices (gpus.py)."""
        return self.etc / "gpu_task_prolog.sh"

    @property
    def prefix(self) -> Path:
        """Where --debs unpacks the carried packages."""
        return self.root / "prefix"

    @property
    def env_script(self) -> Path:
        """`source` it to use the cluster from a shell (SLURM_CONF; with --debs, the prefix's programs)."""
        return self.root / "env.sh"

    def fake_gpu_dir(self, node: str) -> Path:
        return self.root / "dev" / node

    def log(self, daemon: str) -> Path:
        return self.logs / f"{daemon}.log"


# Fields added after cluster.json first had a shape: left out at their defaults, so that the code of
# an older checkout reads the file too (several checkouts share the default cluster).
_LATER_FIELDS = ("node_prefix", "gpus", "accounting", "debs")


def load_shape(paths: ClusterPaths) -> ClusterShape | None:
    if not paths.shape_file.exists():
        return None
    saved = json.loads(paths.shape_file.read_text())
    saved.setdefault("isolated", False)  # written before namespaces were the default: a shared-loopback cluster
    return ClusterShape(**saved)


def save_shape(paths: ClusterPaths, shape: ClusterShape) -> None:
    saved = asdict(shape)
    defaults = {f.name: f.default for f in fields(ClusterShape)}
    for name in _LATER_FIELDS:
        if saved[name] == defaults[name]:
            del saved[name]
    paths.shape_file.write_text(json.dumps(saved, indent=2) + "\n")


def write_private(path: Path, data: bytes) -> None:
    """Write a file readable by its owner only, without a window where it is world-readable."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    path.chmod(0o600)


def render_slurm_conf(paths: ClusterPaths, shape: ClusterShape, first_job_id: int = 1,
                      ctld_addr: str = "127.0.0.1", node_addrs: dict[str, str] | None = None,
                      plugin_dir: Path | None = None) -> str:
    """`node_addrs` (node -> its namespace's address) makes the isolated shape: slurmctld listens
    on `ctld_addr` (the bridge's), and each node is its name at its own address. `plugin_dir`: the
    plugins of carried packages (else SLURM's built-in folder)."""
    auth_info = f"socket={paths.munge_socket},cred_expire={CRED_EXPIRE_S}"
    gres = f" Gres=gpu:{shape.gpus_per_node}" if shape.gpus_per_node else ""
    hosts = {n: (n, node_addrs[n]) if node_addrs else ("localhost", "127.0.0.1") for n in shape.node_names}
    # With namespaces, slurmctld and srun on the host listen on any address: NoCtldInAddrAny and
    # NoInAddrAny bind them to what their host name ("localhost", the host's) resolves to, 127.0.0.1,
    # which the nodes cannot reach; the bridge's address is the one the nodes use.
    communication = "" if node_addrs else "CommunicationParameters=NoCtldInAddrAny,NoInAddrAny"
    where = "each in its own network namespace" if node_addrs else "on loopback"
    nodes = "\n".join(
        f"NodeName={name} NodeHostname={hosts[name][0]} NodeAddr={hosts[name][1]} Port={shape.slurmd_port(k)} "
        f"CPUs={shape.cpus_per_node} RealMemory={shape.memory_mb_per_node}{gres} State=UNKNOWN"
        for k, name in enumerate(shape.node_names, 1)
    )
    return f"""\
# slurmrl devcluster: {shape.nodes} emulated nodes {where}. Generated; edits are overwritten.
ClusterName={CLUSTER_NAME}
SlurmctldHost=localhost({ctld_addr})
SlurmctldPort={shape.slurmctld_port}
{communication}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo={auth_info}
StateSaveLocation={paths.state}/slurmctld
SlurmdSpoolDir={paths.state}/slurmd-%n
SlurmctldPidFile={paths.slurm_run}/slurmctld.pid
SlurmdPidFile={paths.slurm_run}/slurmd-%n.pid
SlurmctldLogFile={paths.logs}/slurmctld.log
SlurmdLogFile={paths.logs}/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
{f"PluginDir={plugin_dir}" if plugin_dir else ""}
{f"TaskProlog={paths.gpu_task_prolog}" if shape.gpus == REAL else ""}
# Emulated nodes declare more than the host has, and need no cgroup setup of their own.
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
# Heterogeneous jobs are scheduled only by backfill: run it every second.
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
GresTypes=gpu
JobRequeue=1
# Past every job id the accounting holds, so new jobs never share an id with an old one there.
FirstJobId={first_job_id}
ReturnToService=2
SlurmdTimeout=30
MessageTimeout=10
KillWait=5
InactiveLimit=0
MinJobAge=300
{_accounting(paths, shape, ctld_addr)}
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
{nodes}
PartitionName={PARTITION} Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


def _accounting(paths: ClusterPaths, shape: ClusterShape, ctld_addr: str) -> str:
    if not shape.accounting:
        return "# No accounting (--no-accounting): sacct answers nothing; slurmrl asks squeue and scontrol.\n" \
               "AccountingStorageType=accounting_storage/none"
    return f"""AccountingStorageType=accounting_storage/slurmdbd
# sacct talks to slurmdbd itself: from a node's namespace, only the bridge's address reaches it.
AccountingStorageHost={ctld_addr}
AccountingStoragePort={shape.slurmdbd_port}
# For slurmdbd this names the munge socket that connections to it authenticate with.
AccountingStoragePass={paths.munge_socket}"""


def render_slurmdbd_conf(paths: ClusterPaths, shape: ClusterShape, db_password: str) -> str:
    return f"""\
# slurmrl devcluster accounting daemon. Generated; holds the database password (mode 0600).
AuthType=auth/munge
AuthInfo=socket={paths.munge_socket}
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort={shape.slurmdbd_port}
SlurmUser=root
PidFile={paths.slurm_run}/slurmdbd.pid
LogFile={paths.logs}/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort={shape.mariadb_port}
StorageUser=slurm
StoragePass={db_password}
StorageLoc={ACCOUNTING_DB}
"""
