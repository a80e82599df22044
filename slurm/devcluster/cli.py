"""`python -m slurm.devcluster up|down|status` (also `slurmrl cluster ...`): the loopback development
cluster from the command line."""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace
from pathlib import Path

from slurm.devcluster import faults, gpus, netns
from slurm.devcluster.cluster import DevCluster
from slurm.devcluster.config import (
    DEFAULT_PORT_BASE,
    DEFAULT_ROOT,
    ClusterPaths,
    ClusterShape,
    load_shape,
)
from slurm.devcluster.daemons import DevclusterError
from slurm.devcluster.host import Host
from slurm.devcluster.install import ensure_installed

HELP = "a real SLURM cluster on loopback for development and tests"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m slurm.devcluster", description=HELP)
    _add_actions(parser)
    args = parser.parse_args(argv)
    return args.func(args)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    _add_actions(subparsers.add_parser("cluster", help=HELP))


def _add_actions(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", required=True, metavar="{up,down,status,cut,slow,heal}")
    up = actions.add_parser("up", help="install what is missing, start every daemon, wait until nodes are idle")
    # Flags left out keep the shape of the cluster last brought up at --dir (else the defaults).
    up.add_argument("--nodes", type=int, help=f"emulated nodes (default {ClusterShape.nodes})")
    up.add_argument("--gpus-per-node", type=int,
                    help=f"GPUs per node, as gres (default {ClusterShape.gpus_per_node})")
    up.add_argument("--gpus", choices=gpus.GPU_CHOICES,
                    help="real: this machine's /dev/nvidia* as gres, each node its own --gpus-per-node of them; "
                         "fake: placeholder files; auto (the default): real where there are any")
    up.add_argument("--cpus-per-node", type=int, help=f"CPUs each node declares (default {ClusterShape.cpus_per_node})")
    up.add_argument("--port-base", type=int, help=f"first of the ports the daemons use (default {DEFAULT_PORT_BASE})")
    up.add_argument("--node-prefix", help=f"node names are PREFIX1..PREFIXN (default {ClusterShape.node_prefix!r}); "
                    "an isolated cluster's names are in /etc/hosts, so two at once need two prefixes")
    net = up.add_mutually_exclusive_group()
    net.add_argument("--isolated", dest="isolated", action="store_const", const=True,
                     help="each node in its own network namespace with its own address on a private bridge "
                          "(the default)")
    net.add_argument("--shared-loopback", dest="isolated", action="store_const", const=False,
                     help="every node is 127.0.0.1, told apart by port (where namespaces are not allowed)")
    accounting = up.add_mutually_exclusive_group()
    accounting.add_argument("--accounting", dest="accounting", action="store_const", const=True,
                            help="MariaDB and slurmdbd, for sacct (the default)")
    accounting.add_argument("--no-accounting", dest="accounting", action="store_const", const=False,
                            help="neither: sacct answers nothing, slurmrl asks squeue and scontrol instead")
    slurm_from = up.add_mutually_exclusive_group()
    slurm_from.add_argument("--debs", type=Path, metavar="DIR",
                            help="run SLURM and munge from the .deb files in DIR (scripts/fetch_slurm_debs.sh), "
                                 "unpacked under --dir, where apt-get reaches no registry; needs --no-accounting")
    slurm_from.add_argument("--system-slurm", dest="debs", action="store_const", const="",
                            help="SLURM installed on this machine, with apt-get if missing (the default)")
    up.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for idle nodes (default %(default)s)")
    actions.add_parser("down", help="cancel all jobs and stop the daemons that `up` started")
    actions.add_parser("status", help="daemons, nodes, partitions and the SLURM_CONF line to export")
    # Network faults, on an isolated cluster only (slurm/devcluster/faults.py).
    cut = actions.add_parser("cut", help="take a node off the network (its link down; its processes live on)")
    slow = actions.add_parser("slow", help="delay and drop packets to and from a node (as netem would)")
    slow.add_argument("--delay-ms", type=float, default=200.0,
                      help="added to each packet, each way (default %(default)s)")
    slow.add_argument("--loss", type=float, default=0.0,
                      help="percent of packets dropped, each way (default %(default)s)")
    heal = actions.add_parser("heal", help="undo cut and slow on a node")
    for fault in (cut, slow, heal):
        fault.add_argument("node", help="the node's name (node1, node2, ...)")
    for action in actions.choices.values():
        action.add_argument("--dir", type=Path, default=DEFAULT_ROOT,
                            help="where configs, state and logs live (default %(default)s, or $SLURMRL_DEVCLUSTER_DIR)")
    parser.set_defaults(func=run, prog=parser.prog)


def run(args: argparse.Namespace) -> int:
    if os.geteuid() != 0:
        _fail(args.prog, f"`{args.prog} {args.action}` must run as root (its daemons run as root and it "
                         "installs Debian packages); run it with sudo or as root")
    try:
        if args.action == "up":
            shape = _requested_shape(args)
            cluster = DevCluster(args.dir, shape)
            cluster.gpu_devices()  # more real GPUs than there are: refused before anything else
            if shape.isolated:
                netns.check_allowed()
            if not shape.debs:
                ensure_installed(shape.accounting)
            cluster.up(timeout_s=args.timeout)
            print(cluster.status())
        elif args.action == "down":
            stopped = DevCluster(args.dir).down()
            print(f"stopped: {', '.join(stopped)}" if stopped else f"no devcluster daemons were running at {args.dir}")
        elif args.action == "status":
            print(DevCluster(args.dir).status())
        else:
            _fault(args)
    except (DevclusterError, TimeoutError) as err:
        _fail(args.prog, str(err))
    return 0


def _fault(args: argparse.Namespace) -> None:
    root = args.dir.resolve()
    if args.action == "cut":
        faults.cut(root, args.node)
    elif args.action == "slow":
        faults.slow(root, args.node, args.delay_ms, args.loss)
    else:
        faults.heal(root, args.node)
    print(f"{args.node}: {faults.state(root, args.node)}")


def _requested_shape(args: argparse.Namespace) -> ClusterShape:
    debs = None if args.debs is None else str(args.debs.resolve()) if args.debs else ""
    flags = {"nodes": args.nodes, "gpus_per_node": args.gpus_per_node, "cpus_per_node": args.cpus_per_node,
             "port_base": args.port_base, "isolated": args.isolated, "node_prefix": args.node_prefix,
             "accounting": args.accounting, "debs": debs}
    saved = load_shape(ClusterPaths(args.dir.resolve()))
    shape = replace(saved or ClusterShape(), **{k: v for k, v in flags.items() if v is not None})
    # --gpus left out: as the cluster last brought up at --dir, else auto.
    choice = args.gpus or (saved.gpus if saved else gpus.AUTO)
    shape = replace(shape, gpus=gpus.resolve(choice, shape.gpus_per_node, Host().dev))
    try:
        shape.validate()
    except ValueError as err:
        _fail(args.prog, str(err))
    return shape


def _fail(prog: str, message: str) -> None:
    print(f"{prog}: error: {message}", file=sys.stderr)
    sys.exit(1)
