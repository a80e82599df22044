"""`python -m supervisor.node_rank MODULE ARGS...`: one task of an engine that spans several nodes
(one srun step, one task per node) runs `python -m MODULE ARGS...` with its own node's
`--node-rank` and `--host`, in this process.

The step's command line is node-rank 0's; each task finds its rank by its node's name
(SLURMD_NODENAME) in the engine's node list, node 0 first, which the supervisor puts in the step's
environment: SLURM numbers a step's nodes (SLURM_NODEID) in its own node order, not in the order
asked for, and node 0 must be the one whose address the router, the trainer and --dist-init-addr
name (after a move to a spare node it need not come first in SLURM's order).
"""

from __future__ import annotations

import os
import runpy
import sys
from collections.abc import Mapping

from slurm import env as slurm_env

MODULE = "supervisor.node_rank"
NODES_ENV = "SLURMRL_ENGINE_NODES"  # the engine's nodes, comma-separated, node-rank 0 first
HOSTS_ENV = "SLURMRL_ENGINE_HOSTS"  # their addresses (each task's --host), in the same order
NODE_NAME_ENV = slurm_env.NODE_NAME  # set by slurmd in every task: the node it runs on


class NodeRankError(RuntimeError):
    """The task cannot tell which node of the engine it runs on."""


def step_env(nodes: tuple[str, ...], hosts: tuple[str, ...]) -> dict[str, str]:
    """What the supervisor adds to a multi-node engine step's environment."""
    return {NODES_ENV: ",".join(nodes), HOSTS_ENV: ",".join(hosts)}


def wrapped(argv: list[str]) -> list[str]:
    """[python, -m, MODULE, ARGS...] run through this module on each node of the step."""
    python, dash_m, module, *args = argv
    if dash_m != "-m":
        raise ValueError(f"not a python -m command line: {argv}")
    return [python, "-m", MODULE, module, *args]


def this_node(env: Mapping[str, str]) -> tuple[int, str]:
    """(node rank, address) of the node this task runs on."""
    nodes, hosts = env.get(NODES_ENV, "").split(","), env.get(HOSTS_ENV, "").split(",")
    name = env.get(NODE_NAME_ENV)
    if name not in nodes or len(hosts) != len(nodes):
        raise NodeRankError(f"node {name!r} ({NODE_NAME_ENV}) is not one of the engine's nodes {nodes} "
                            f"({NODES_ENV}, with their addresses in {HOSTS_ENV})")
    rank = nodes.index(name)
    return rank, hosts[rank]


def node_argv(args: list[str], rank: int, host: str) -> list[str]:
    """Node-rank 0's flags as node `rank` (bound to `host`) takes them."""
    out, values = [], {"--node-rank": str(rank), "--host": host}
    given = iter(args)
    for token in given:
        name = token.split("=", 1)[0]
        if name in values and "=" in token:
            out.append(f"{name}={values[name]}")
        elif name in values:
            out += [name, values[name]]
            next(given, None)
        else:
            out.append(token)
    missing = [name for name in values if name not in {t.split("=", 1)[0] for t in out}]
    return out + [t for name in missing for t in (name, values[name])]


def main() -> None:
    if len(sys.argv) < 2:
        print("usage: python -m supervisor.node_rank MODULE [ARGS...] (inside an engine's step)", file=sys.stderr)
        raise SystemExit(2)
    try:
        rank, host = this_node(os.environ)
    except NodeRankError as err:
        print(f"supervisor.node_rank: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    module = sys.argv[1]
    sys.argv = [module, *node_argv(sys.argv[2:], rank, host)]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
