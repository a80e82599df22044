"""Where each step runs: the allocation's nodes (from SLURM's environment), their addresses, and
the placement and port of the router, every engine and the trainer."""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from contract import engine_groups
from contract.spec import JobSpec
from slurm import env as slurm_env
from slurm.client import SlurmClient

# Ports: spread over jobs by job id, so two jobs on one node rarely meet; engine k gets base + 10 + k
# (HTTP) and, spanning nodes, base + 10 + engines + k (--dist-init-addr on its node 0), and a prefill
# engine base + 10 + 2 x engines + k (its bootstrap server): no two ports of a job meet, even on a
# cluster whose nodes share one address (the devcluster).
# All below Linux's ephemeral range (32768 and up), where any outgoing connection may sit.
_PORT_BASE, _PORT_SPAN, _PORTS_PER_JOB = 20000, 12000, 100


@dataclass(frozen=True)
class EnginePlace:
    name: str  # engine-0, engine-1, ...
    index: int
    nodes: tuple[str, ...]
    address: str  # node-rank 0's address: where the router and the trainer reach it
    port: int
    het_group: int
    gpus_per_node: int
    dist_init_port: int | None = None  # an engine of several nodes: its node 0's rendezvous port
    role: str = "regular"  # regular, prefill or decode (contract/engine_groups.py)
    bootstrap_port: int | None = None  # a prefill engine's KV bootstrap server, on its node 0

    @property
    def url(self) -> str:
        return f"http://{self.address}:{self.port}"

    @property
    def dist_init_addr(self) -> str | None:
        """SGLang's --dist-init-addr (node-rank 0's HOST:PORT) of an engine that spans nodes."""
        return f"{self.address}:{self.dist_init_port}" if len(self.nodes) > 1 else None


@dataclass(frozen=True)
class Layout:
    job_id: str
    head: str  # the node the supervisor (batch step), the router and trainer rank 0 run on
    head_address: str
    trainer_nodes: tuple[str, ...]
    rollout_nodes: tuple[str, ...]  # the engines' nodes, then the spare ones
    router_port: int
    router_metrics_port: int
    trainer_master_port: int
    engines: tuple[EnginePlace, ...]
    spare_nodes: tuple[str, ...] = ()  # rollout nodes no engine starts on: where engines of a lost node go
    addresses: dict[str, str] = field(default_factory=dict)  # every node's address

    def moved(self, place: EnginePlace, swap: dict[str, str]) -> EnginePlace:
        """`place` with each node of `swap` replaced by its value, another node of the allocation
        (same ports: no other step of the job runs there); its node 0 stays its node 0."""
        nodes = tuple(swap.get(node, node) for node in place.nodes)
        return replace(place, nodes=nodes, address=self.addresses[nodes[0]])


def port_free_here(address: str, preferred: int) -> int:
    """`preferred` if it can be bound on this node now, else a port the kernel picks (for the
    steps on the supervisor's own node: the router and the trainer's master)."""
    for port in (preferred, 0):
        with socket.socket() as probe:
            try:
                probe.bind((address, port))
            except OSError:
                continue
            return probe.getsockname()[1]
    raise OSError(f"no free port on {address}")


def node_addresses(nodes: list[str], slurm: SlurmClient) -> dict[str, str]:
    """NodeAddr of each node, in one scontrol call (a devcluster's nodes all live on 127.0.0.1)."""
    out = slurm.require("scontrol", "show", "node", "-o", ",".join(nodes))
    addresses = {}
    for line in out.splitlines():
        fields = dict(part.split("=", 1) for part in line.split() if "=" in part)
        if "NodeName" in fields:
            addresses[fields["NodeName"]] = fields.get("NodeAddr", fields["NodeName"])
    return {node: _resolve(addresses.get(node, node)) for node in nodes}


def _resolve(address: str) -> str:
    try:
        return socket.gethostbyname(address)
    except OSError:
        return address


def from_environment(spec: JobSpec, timeout_s: float, env: Mapping[str, str] | None = None) -> Layout:
    """The layout of the job this process runs in; timeout_s bounds each scontrol call."""
    env = os.environ if env is None else env
    slurm = SlurmClient(timeout_s)
    job_id = slurm_env.job_id(env)
    if not job_id:
        raise ValueError("SLURM_JOB_ID is not set: the supervisor runs as a SLURM job's batch step "
                         "(slurmrl submit, or sbatch a template of slurm/templates)")
    groups = [slurm.hostnames(slurm_env.job_nodelist(g, env)) for g in range(spec.het_groups)]
    trainer_nodes = groups[0]
    rollout_nodes = groups[spec.rollout_group] if spec.starts_engines else []  # --debug-train-only: none
    addresses = node_addresses(sorted(set(trainer_nodes) | set(rollout_nodes)), slurm)
    base = _PORT_BASE + (int(job_id) * _PORTS_PER_JOB) % _PORT_SPAN
    engines, engine_nodes = _engine_places(spec, rollout_nodes, addresses, base) if rollout_nodes else ([], [])
    head = trainer_nodes[0]
    return Layout(job_id=job_id, head=head, head_address=addresses[head], trainer_nodes=tuple(trainer_nodes),
                  rollout_nodes=tuple(rollout_nodes), router_port=base, router_metrics_port=base + 1,
                  trainer_master_port=base + 2, engines=tuple(engines),
                  spare_nodes=tuple(rollout_nodes[len(engine_nodes):]), addresses=addresses)


def _engine_places(spec: JobSpec, rollout_nodes: list[str], addresses: dict[str, str],
                   base: int) -> tuple[list[EnginePlace], list[str]]:
    """Each engine's place on the rollout nodes, and the nodes engines start on (the rest are spares)."""
    r = spec.rollout
    span = r.nodes_per_engine
    gpus = r.gpus_per_engine_step
    engine_nodes = rollout_nodes[:max(1, len(rollout_nodes) - r.spare_nodes)]
    if span > 1 and len(engine_nodes) < r.engine_count * span:
        raise ValueError(f"{r.engine_count} engines of {span} nodes need {r.engine_count * span} rollout nodes "
                         f"besides the {r.spare_nodes} spare ones; the allocation has {len(rollout_nodes)}")
    engines = []
    for k, (role, _) in enumerate(engine_groups.engine_roles(spec)):
        if span > 1:  # whole nodes, its own: node 0 (the rendezvous and the HTTP port) first
            nodes = tuple(engine_nodes[k * span:(k + 1) * span])
            dist_port = base + 10 + r.engine_count + k
        else:
            nodes, dist_port = (engine_nodes[(k // r.engines_on_each_node) % len(engine_nodes)],), None
        bootstrap_port = base + 10 + 2 * r.engine_count + k if role == "prefill" else None
        engines.append(EnginePlace(f"engine-{k}", k, nodes, addresses[nodes[0]], base + 10 + k, spec.rollout_group,
                                   gpus, dist_port, role, bootstrap_port))
    return engines, engine_nodes
