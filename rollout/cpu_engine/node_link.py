"""A CPU engine over several nodes, as SGLang's `--nnodes N --node-rank R --dist-init-addr HOST:PORT`:
one process per node, joined in a gloo process group that node rank 0 hosts at --dist-init-addr.

Node rank 0 is the engine (model, scheduler, HTTP); like SGLang's, the other ranks serve no HTTP.
They follow rank 0: a liveness exchange (one gloo allreduce every HEARTBEAT_S, which rank 0 also
uses to hand them commands) and their part in weight updates over an update group, where rank R
joins as rank_offset + R, as SGLang's tensor-parallel ranks do, so a trainer's update group spans
every rank of the engine. The weights they receive are dropped: on CPU rank 0 holds the whole model.

As in SGLang, where a dead tensor-parallel rank ends the whole server: a rank that does not take
part in an exchange within PEER_TIMEOUT_S fails the engine (rank 0 exits non-zero), and the
other ranks exit non-zero once rank 0 is gone.
"""

from __future__ import annotations

import json
import os
import queue
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from rollout.cpu_engine.args import ServerArgs
from rollout.weight_group import (
    UpdateGroup,
    WeightSyncError,
    create_group,
    parse_dtype,
    route_address,
)

HEARTBEAT_S = 0.5  # between two liveness exchanges of rank 0 with the others
PEER_TIMEOUT_S = 10.0  # one exchange: a rank silent this long is taken for dead
JOIN_TIMEOUT_S = 300.0  # every rank of the engine meeting at --dist-init-addr after the start
_PREFIX = "cpu_engine_nodes/"


class NodeLinkError(RuntimeError):
    """The engine's ranks could not meet."""


def join(args: ServerArgs) -> tuple[dist.ProcessGroupGloo, dist.Store]:
    """The engine's process group (rank = node rank), once every rank has joined; the store must
    live as long as the group."""
    if not args.dist_init_addr:
        raise NodeLinkError(f"node rank {args.node_rank}: no dist_init_addr, where the engine's ranks meet")
    host, _, port = args.dist_init_addr.rpartition(":")
    timeout = timedelta(seconds=JOIN_TIMEOUT_S)
    try:
        tcp = dist.TCPStore(host, int(port), args.nnodes, is_master=args.node_rank == 0, timeout=timeout)
        store = dist.PrefixStore(_PREFIX, tcp)
        # All ranks are here before the mesh is built, so PEER_TIMEOUT_S only has to cover connecting.
        store.set(f"joined/{args.node_rank}", "1")
        store.wait([f"joined/{rank}" for rank in range(args.nnodes)], timeout)
        # torch 2.13's stubs lag its Gloo binding: no _Options, nor the constructor that takes them.
        gloo: Any = dist.ProcessGroupGloo
        options = gloo._Options()
        options._timeout = timedelta(seconds=PEER_TIMEOUT_S)
        options._devices = [gloo.create_device(hostname=route_address(host, int(port)))]
        return gloo(store, args.node_rank, args.nnodes, options), tcp
    except (RuntimeError, OSError, ValueError) as err:
        raise NodeLinkError(f"node rank {args.node_rank} of {args.nnodes} could not join the engine's ranks at "
                            f"{args.dist_init_addr} within {JOIN_TIMEOUT_S:.0f} s: {err}") from err


def exchange(pg: dist.ProcessGroupGloo, command: dict[str, Any] | None) -> dict[str, Any] | None:
    """One liveness exchange: rank 0 gives `command` (or None), every rank returns it. RuntimeError
    when a rank did not take part within PEER_TIMEOUT_S (or is gone)."""
    timeout = timedelta(seconds=PEER_TIMEOUT_S)
    group: Any = pg  # torch 2.13's stubs lack the Gloo group's collectives (allreduce, broadcast)
    data = json.dumps(command).encode() if command is not None else b""
    size = torch.tensor([len(data)], dtype=torch.int64)  # summed: the other ranks add 0
    group.allreduce([size], dist.AllreduceOptions()).wait(timeout)
    if not size.item():
        return None
    buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(int(size.item()),
                                                                                           dtype=torch.uint8)
    options = dist.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([buffer], options).wait(timeout)
    return json.loads(bytes(buffer.tolist()))


class NodeLink:
    """Rank 0's side: the liveness exchange in its own thread, and commands for the other ranks
    (sent at once, in order). `on_lost(reason)` is called once when a rank is gone."""

    def __init__(self, pg: dist.ProcessGroupGloo, store: dist.Store, on_lost: Callable[[str], None]) -> None:
        self._pg, self._store = pg, store
        self._on_lost = on_lost
        self._outbox: queue.Queue[dict[str, Any]] = queue.Queue()
        threading.Thread(target=self._run, name="cpu-engine-node-link", daemon=True).start()

    def send(self, op: str, **fields: Any) -> None:
        self._outbox.put({"op": op, **fields})

    def _run(self) -> None:
        while True:
            try:
                command = self._outbox.get(timeout=HEARTBEAT_S)
            except queue.Empty:
                command = None
            try:
                exchange(self._pg, command)
            except RuntimeError as err:
                self._on_lost(f"a node rank did not answer within PEER_TIMEOUT_S {PEER_TIMEOUT_S:.0f} s: {err}")
                return


def lead(args: ServerArgs) -> NodeLink:
    """Rank 0: meet the other ranks; a rank lost later ends this process with exit code 1."""
    def lost(reason: str) -> None:
        print(f"cpu_engine: error: {reason}; the engine stops", flush=True)
        os._exit(1)  # from the link's thread: the server must not go on without its ranks

    pg, store = join(args)
    print(f"cpu_engine: node rank 0 of {args.nnodes} leads at {args.dist_init_addr}", flush=True)
    return NodeLink(pg, store, lost)


class _Follower:
    """A rank > 0's part in weight updates, one command at a time in its own thread (the liveness
    exchange goes on meanwhile). A failed command is reported; the trainer's side fails with it."""

    def __init__(self, args: ServerArgs) -> None:
        self.args = args
        self.groups: dict[str, UpdateGroup] = {}
        self.inbox: queue.Queue[dict[str, Any]] = queue.Queue()
        threading.Thread(target=self._run, name="cpu-engine-follower", daemon=True).start()

    def _run(self) -> None:
        while True:
            command = self.inbox.get()
            try:
                self._do(command)
            except (WeightSyncError, RuntimeError, KeyError) as err:
                print(f"cpu_engine: node rank {self.args.node_rank}: {command['op']} failed: {err}", flush=True)

    def _do(self, command: dict[str, Any]) -> None:
        op, name = command["op"], command.get("group_name", "")  # every op but an unknown one names its group
        if op == "join":
            self.groups[name] = create_group(command["master_address"], command["master_port"],
                                             command["rank_offset"] + self.args.node_rank, command["world_size"],
                                             name, self.args.weight_update_group_timeout)
        elif op == "receive":  # as rank 0 receives it: one flattened broadcast, or one per tensor
            receive = self.groups[name].receive_flat if command.get("flattened") else self.groups[name].receive
            receive(command["names"], [parse_dtype(d) for d in command["dtypes"]], command["shapes"])
        elif op == "destroy":
            self.groups.pop(name).close()


def follow(args: ServerArgs) -> int:
    """A rank > 0: join, then follow rank 0 until it is gone (exit code 1)."""
    try:
        pg, _store = join(args)
    except NodeLinkError as err:
        print(f"cpu_engine: error: {err}", flush=True)
        return 1
    print(f"cpu_engine: node rank {args.node_rank} of {args.nnodes} (pid {os.getpid()}) follows node rank 0 "
          f"at {args.dist_init_addr}", flush=True)
    follower = _Follower(args)
    while True:
        try:
            command = exchange(pg, None)
        except RuntimeError as err:
            print(f"cpu_engine: error: node rank 0 did not answer within PEER_TIMEOUT_S {PEER_TIMEOUT_S:.0f} s "
                  f"({err}); node rank {args.node_rank} stops", flush=True)
            return 1
        if command is not None:
            follower.inbox.put(command)
