"""Engines over several nodes at submit time, without SLURM: every node rank's command line (what
supervisor/node_rank.py makes of node-rank 0's inside the step) parses with SGLang's own parser;
the rollout group asks for whole nodes; topologies that cannot run are refused with the field and
the fix."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from jobs.sglang_args import parse_errors
from contract.spec import SpecError
from jobs.submit import prepare, render_script
from jobs.validate import PartitionInfo
from slurm.client import SlurmClient
from supervisor import layout
from supervisor.launcher import engine_command
from supervisor.node_rank import node_argv
from tests.jobs.helpers import job_flags
from tests.jobs.test_sglang_args import RECIPE_FLAGS, needs_parser

BIG = {"dev": PartitionInfo("dev", nodes=8, cpus_per_node=8, gpus_per_node=8)}
TWO_NODE_SGLANG = ["--rollout-engine", "sglang", "--rollout-num-gpus", "32", "--rollout-num-gpus-per-engine", "16",
                   "--rollout-num-gpus-per-node", "8"]
TWO_NODE_CPU = ["--rollout-num-engines", "1", "--rollout-num-gpus-per-engine", "8", "--rollout-num-gpus-per-node", "4"]


def node_rank_argvs(flags: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """Node ranks 0 and 1 of every engine of the job, as each task runs it (with the job's key)."""
    spec = prepare(None, job_flags(tmp_path, "multinode") + flags, partitions=BIG)
    monkeypatch.setattr(SlurmClient, "hostnames", lambda self, nodelist: nodelist.split(","))
    monkeypatch.setattr(layout, "node_addresses", lambda nodes, timeout_s: {n: f"10.0.0.{n[1:]}" for n in nodes})
    env = {"SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST_HET_GROUP_0": "n0",
           "SLURM_JOB_NODELIST_HET_GROUP_1": ",".join(f"n{k}" for k in range(1, 1 + spec.rollout.num_nodes))}
    argvs = []
    for place in layout.from_environment(spec, 1.0, env).engines:
        flags0 = engine_command(spec, place, sys.executable)[3:] + ["--api-key=KEY"]
        argvs += [node_argv(flags0, rank, f"10.0.0.{node[1:]}") for rank, node in enumerate(place.nodes)]
    return argvs


@needs_parser
def test_every_node_ranks_command_line_parses_with_sglangs_own_parser(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    argvs = node_rank_argvs(TWO_NODE_SGLANG + RECIPE_FLAGS, tmp_path, monkeypatch)
    argvs += node_rank_argvs(TWO_NODE_CPU, tmp_path, monkeypatch)  # the CPU engine takes SGLang's flags
    assert len(argvs) == 6
    assert parse_errors(argvs) == [None] * 6
    for argv in argvs[:2]:  # engine-0 of the sglang job: ranks 0 and 1 on n1 and n2, one TP group of 16
        assert argv[argv.index("--tp-size") + 1] == "16" and argv[argv.index("--nnodes") + 1] == "2"
        assert argv[argv.index("--dist-init-addr") + 1] == argvs[0][argvs[0].index("--host") + 1] + ":24212"
    assert [a[a.index("--node-rank") + 1] for a in argvs[:2]] == ["0", "1"]
    assert [a[a.index("--host") + 1] for a in argvs[:2]] == ["10.0.0.1", "10.0.0.2"]


def test_a_two_node_cpu_engine_asks_for_whole_nodes(tmp_path: Path) -> None:
    spec = prepare(None, job_flags(tmp_path, "cpu2") + TWO_NODE_CPU + ["--rollout-spare-nodes", "1"],
                   partitions=BIG)
    rollout = render_script(spec).split("\n\n# setup")[0].split("#SBATCH hetjob\n")[1]
    assert "#SBATCH --nodes=3\n" in rollout and "#SBATCH --ntasks-per-node=1\n" in rollout


@pytest.mark.parametrize("flags, problem", [
    (["--rollout-engine", "sglang", "--rollout-num-gpus", "24", "--rollout-num-gpus-per-engine", "12",
      "--rollout-num-gpus-per-node", "8"],
     "rollout.rollout_num_gpus_per_engine: 12 does not tile nodes of 8 GPUs; an engine must fit a node evenly or "
     "span whole nodes: give a divisor or a multiple of 8"),
    (["--rollout-engine", "sglang", "--rollout-num-gpus", "24", "--rollout-num-gpus-per-engine", "16",
      "--rollout-num-gpus-per-node", "8"],
     "rollout.rollout_num_gpus: 24 is not a multiple of rollout_num_gpus_per_engine 16; give --rollout-num-gpus 16"),
    (["--rollout-num-engines", "1", "--rollout-num-gpus-per-engine", "6", "--rollout-num-gpus-per-node", "4"],
     "rollout.rollout_num_gpus_per_engine: 6 does not span whole nodes of 4 GPUs (rollout_num_gpus_per_node); "
     "give a multiple of 4"),
    (TWO_NODE_CPU + ["--rollout-engines-per-node", "2"],
     "rollout.engines_per_node: 2, but each engine spans 2 whole nodes; drop --rollout-engines-per-node"),
    (TWO_NODE_CPU + ["--rollout-num-engines", "4"], "rollout group: 8 nodes, but partition dev has 4; ask for fewer nodes"),
])
def test_engines_that_cannot_span_nodes_are_refused(tmp_path: Path, flags: list[str], problem: str) -> None:
    dev = {"dev": PartitionInfo("dev", nodes=4, cpus_per_node=8, gpus_per_node=8)}
    with pytest.raises(SpecError) as err:
        prepare(None, job_flags(tmp_path, "bad") + flags, partitions=dev)
    assert problem in str(err.value).splitlines(), str(err.value)
