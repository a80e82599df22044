"""A gloo process group between a trainer (rank 0, the source) and engine ranks, for broadcasting
new weights.

The group is built from a TCPStore and a ProcessGroupGloo directly instead of through
torch.distributed's default group, so neither side's own distributed state is touched and a
process may hold several groups. The store keys are prefixed as SGLang's
init_custom_process_group prefixes them, so a trainer may use either that helper or this one.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

_DTYPES = {name: getattr(torch, name) for name in ("float32", "float16", "bfloat16", "float64")}


class WeightSyncError(Exception):
    """A group cannot be created or a broadcast request is malformed."""


@dataclass
class UpdateGroup:
    name: str
    rank: int
    world_size: int
    store: dist.Store  # held so the rendezvous store (hosted by rank 0) lives as long as the group
    pg: dist.ProcessGroupGloo

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        """Send (on src) or receive (elsewhere) one tensor, in place."""
        options = dist.BroadcastOptions()
        options.rootRank = src
        self.pg.broadcast([tensor], options).wait()

    def close(self) -> None:
        self.pg.shutdown()


def parse_dtype(name: str) -> torch.dtype:
    """'bfloat16' or 'torch.bfloat16' (how trainers write str(tensor.dtype))."""
    dtype = _DTYPES.get(name.removeprefix("torch.")) if isinstance(name, str) else None
    if dtype is None:
        raise WeightSyncError(f"unsupported dtype {name!r}; expected one of {', '.join(_DTYPES)}")
    return dtype


def create_group(master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
                 timeout_s: float) -> UpdateGroup:
    """Join (rank >= 1) or host (rank 0) the group; returns once every rank has joined."""
    if not 0 <= rank < world_size:
        raise WeightSyncError(f"rank {rank} is outside a group of world_size {world_size}")
    timeout = timedelta(seconds=timeout_s)
    try:
        tcp = dist.TCPStore(master_address, master_port, world_size, is_master=rank == 0, timeout=timeout,
                            multi_tenant=True)
        store = dist.PrefixStore("cpu/", dist.PrefixStore(f"{group_name}/", dist.PrefixStore(group_name, tcp)))
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=_local_address(master_address, master_port))]
        pg = dist.ProcessGroupGloo(store, rank, world_size, options)
    except (RuntimeError, OSError, ValueError) as err:
        raise WeightSyncError(f"cannot join group {group_name!r} at {master_address}:{master_port} "
                              f"as rank {rank}: {err}") from err
    return UpdateGroup(name=group_name, rank=rank, world_size=world_size, store=tcp, pg=pg)


def receive(group: UpdateGroup, names: list[str], dtypes: list[torch.dtype],
            shapes: list[list[int]]) -> dict[str, torch.Tensor]:
    """Receive one broadcast per name, in order, from rank 0."""
    tensors = {}
    for name, dtype, shape in zip(names, dtypes, shapes):
        tensor = torch.empty(shape, dtype=dtype)
        group.broadcast(tensor, src=0)
        tensors[name] = tensor
    return tensors


def _local_address(master_address: str, master_port: int) -> str:
    """This host's address on the route to the master, so gloo binds an interface it can reach
    (a node's hostname may resolve to an address the other side cannot use)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((master_address, master_port))  # UDP: picks the route, sends nothing
        return probe.getsockname()[0]
