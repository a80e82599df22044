"""The `slurmrl` command: one console script, a subcommand per area of the suite."""

from __future__ import annotations

import argparse

from ckpt_tools import cli as ckpt_cli
from rollout import cli as rollout_cli
from slurm.devcluster import cli as cluster_cli


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="slurmrl", description="SLURM-native RL post-training: submit, watch and steer jobs")
    subparsers = parser.add_subparsers(dest="command", required=True)
    cluster_cli.add_parser(subparsers)
    ckpt_cli.add_parser(subparsers)
    rollout_cli.add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
