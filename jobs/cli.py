"""The `slurmrl` command: one console script, a subcommand per area of the suite."""

from __future__ import annotations

import argparse
import sys

from ckpt_tools import cli as ckpt_cli
from jobs import submit_cli
from rollout import cli as rollout_cli
from slurm.devcluster import cli as cluster_cli
from supervisor import cli as supervisor_cli
from supervisor import profile_cli, report


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="slurmrl", description="SLURM-native RL post-training: submit, watch and steer jobs")
    subparsers = parser.add_subparsers(dest="command", required=True)
    cluster_cli.add_parser(subparsers)
    ckpt_cli.add_parser(subparsers)
    rollout_cli.add_parser(subparsers)
    submit_cli.add_parser(subparsers)
    supervisor_cli.add_parsers(subparsers)
    profile_cli.add_parser(subparsers)
    report.add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["submit"]:  # its flags are the spec's and the trainer's: read by submit_cli itself
        return submit_cli.main(argv[1:])
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
