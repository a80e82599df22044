"""The devcluster's layout on disk, its ports, and the config files it renders.

Everything lives under one root directory; nothing is written to /etc, /run or /var.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path

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
        ports = {"mariadb": self.mariadb_port, "slurmctld": self.slurmctld_port, "slurmdbd": self.slurmdbd_port}
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

    def fake_gpu_dir(self, node: str) -> Path:
        return self.root / "dev" / node

    def log(self, daemon: str) -> Path:
        return self.logs / f"{daemon}.log"

    def env_line(self) -> str:
        return f"export SLURM_CONF={self.slurm_conf}"


def load_shape(paths: ClusterPaths) -> ClusterShape | None:
    if not paths.shape_file.exists():
        return None
    fields = json.loads(paths.shape_file.read_text())
    fields.setdefault("isolated", False)  # written before namespaces were the default: a shared-loopback cluster
    return ClusterShape(**fields)


def save_shape(paths: ClusterPaths, shape: ClusterShape) -> None:
    fields = asdict(shape)
    if shape.node_prefix == ClusterShape.node_prefix:  # a file code from before --node-prefix reads too
        del fields["node_prefix"]
    paths.shape_file.write_text(json.dumps(fields, indent=2) + "\n")


def render_slurm_conf(paths: ClusterPaths, shape: ClusterShape, first_job_id: int = 1,
                      ctld_addr: str = "127.0.0.1", node_addrs: dict[str, str] | None = None) -> str:
    """`node_addrs` (node -> its namespace's address) makes the isolated shape: slurmctld listens
    on `ctld_addr` (the bridge's), and each node is its name at its own address."""
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
# Emulated nodes declare more than the host has, and need no cgroup setup.
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
AccountingStorageType=accounting_storage/slurmdbd
# sacct talks to slurmdbd itself: from a node's namespace, only the bridge's address reaches it.
AccountingStorageHost={ctld_addr}
AccountingStoragePort={shape.slurmdbd_port}
# For slurmdbd this names the munge socket that connections to it authenticate with.
AccountingStoragePass={paths.munge_socket}
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
{nodes}
PartitionName={PARTITION} Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


def render_gres_conf(paths: ClusterPaths, shape: ClusterShape) -> str:
    lines = ["# Fake GPUs: links to /dev/null, one per GPU. Generated.", "AutoDetect=off"]
    if shape.gpus_per_node:
        last = shape.gpus_per_node - 1
        lines += [
            f"NodeName={node} Name=gpu File={paths.fake_gpu_dir(node)}/nvidia[0-{last}]"
            for node in shape.node_names
        ]
    return "\n".join(lines) + "\n"


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
