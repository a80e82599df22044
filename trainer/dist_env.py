"""torch.distributed's environment for the trainer: from a SLURM step, torchrun, or nothing.

In a SLURM step each task is one rank: RANK = SLURM_PROCID, WORLD_SIZE = SLURM_NTASKS,
LOCAL_RANK = SLURM_LOCALID, and the master is the step's first node (for a heterogeneous job,
the first node of the trainer's group, which is the group the step runs in). torchrun's
variables, when present, win; a lone process gets a world of one.
"""

from __future__ import annotations

import os
import socket
from collections.abc import MutableMapping
from datetime import timedelta

from slurm import env as slurm_env
from slurm.client import SlurmClient

# Ports below this are the devcluster's and the usual services'; the job id spreads jobs apart.
_PORT_BASE, _PORT_SPAN = 20000, 20000
# Until every rank joined the rendezvous: torch's own default for it (ranks load models first).
_RENDEZVOUS_TIMEOUT = timedelta(minutes=30)
_LISTEN_BACKLOG = 1024  # ranks connecting at once
DEFAULT_TIMEOUT_MINUTES = 10  # slime's --distributed-timeout-minutes


def first_node(nodelist: str) -> str:
    """The first host of a SLURM nodelist expression ("node[1-3],gpu7" -> "node1")."""
    return SlurmClient().hostnames(nodelist)[0]


def master_address(host: str) -> str:
    """The address other nodes reach `host` on (devcluster nodes are names for 127.0.0.1)."""
    try:
        return socket.gethostbyname(host)
    except OSError:
        return host


def setup(env: MutableMapping[str, str] = os.environ, master_port: int | None = None) -> None:
    """Fill RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT in `env` where missing."""
    if "RANK" in env and "WORLD_SIZE" in env:
        return  # torchrun, or set by hand
    if slurm_env.PROCID in env and slurm_env.STEP_NODELIST in env:
        env["RANK"], env["WORLD_SIZE"] = env[slurm_env.PROCID], env[slurm_env.NTASKS]
        env["LOCAL_RANK"] = env.get(slurm_env.LOCALID, "0")
        env.setdefault("MASTER_ADDR", master_address(first_node(env[slurm_env.STEP_NODELIST])))
        job = int(slurm_env.job_id(env) or "0")
        env.setdefault("MASTER_PORT", str(master_port or _PORT_BASE + job % _PORT_SPAN))
        return
    env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"] = "0", "1", "0"
    env.setdefault("MASTER_ADDR", "127.0.0.1")
    env.setdefault("MASTER_PORT", str(master_port or _free_port()))


def init_process_group(backend: str | None = None, timeout_minutes: int = DEFAULT_TIMEOUT_MINUTES) -> None:
    """The default process group from the environment setup() filled: NCCL with GPUs, else gloo
    (--distributed-backend, if given, must be that one); a collective that waits longer than
    timeout_minutes fails (--distributed-timeout-minutes)."""
    import torch
    import torch.distributed as dist

    from trainer.args_actions import ArgsError
    from trainer.config.device_checks import distributed_backend_problem

    if dist.is_initialized():
        return
    problem = distributed_backend_problem(backend, "cuda" if torch.cuda.is_available() else "cpu")
    if problem is not None:
        raise ArgsError(problem)
    if torch.cuda.is_available():
        # SLURM may already have narrowed CUDA_VISIBLE_DEVICES to this task's GPU.
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    timeout = timedelta(minutes=timeout_minutes)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        dist.init_process_group(backend, timeout=timeout)  # torchrun's agent hosts the store already
        return
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if backend == "gloo" and "GLOO_SOCKET_IFNAME" not in os.environ:
        interface = _interface_towards(address, port)
        if interface is not None:
            os.environ["GLOO_SOCKET_IFNAME"] = interface
    if rank == 0:
        # The rendezvous store on the master node's own address only: torch's env:// store would
        # listen on every interface of the node.
        listener = socket.create_server((address, port), backlog=_LISTEN_BACKLOG)
        store = dist.TCPStore(address, port, world, True, timeout=_RENDEZVOUS_TIMEOUT,
                              master_listen_fd=listener.detach())
    else:
        store = dist.TCPStore(address, port, world, False, timeout=_RENDEZVOUS_TIMEOUT)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)


def _interface_towards(address: str, port: int) -> str | None:
    """The network interface on this node's route to address:port. Without one named, gloo binds
    what the machine's hostname resolves to, which may be 127.0.0.1 (a devcluster node's own
    namespace, a container's /etc/hosts): the other nodes' ranks could not connect back."""
    import psutil

    from rollout.weight_group import route_address

    own = route_address(address, port)
    return next((name for name, addrs in psutil.net_if_addrs().items()
                 if any(a.family == socket.AF_INET and a.address == own for a in addrs)), None)


def shutdown() -> None:
    """End the process groups together: left to the interpreter's exit, a gloo group's threads can
    abort the process ("terminate called without an active exception"), a failed exit code."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
