"""Spare rollout nodes and --no-kill in the rendered script, without SLURM."""

from __future__ import annotations

from pathlib import Path

import pytest

from contract.spec import SpecError
from jobs.submit import prepare, render_script
from jobs.validate import PartitionInfo
from tests.jobs.helpers import job_flags

DEV = {"dev": PartitionInfo("dev", nodes=4, cpus_per_node=8, gpus_per_node=4)}


def test_spare_nodes_join_the_rollout_group_and_every_group_asks_no_kill(tmp_path: Path) -> None:
    spec = prepare(None, job_flags(tmp_path, "spare") + ["--rollout-engines-per-node", "1",
                                                         "--rollout-spare-nodes", "1"], partitions=DEV)
    assert spec.rollout.spare_nodes == 1 and spec.rollout.num_nodes == 2
    trainer, rollout = render_script(spec).split("\n\n# setup")[0].split("#SBATCH hetjob\n")
    assert "#SBATCH --nodes=1\n" in trainer and "#SBATCH --nodes=3\n" in rollout
    assert "#SBATCH --no-kill\n" in trainer and "#SBATCH --no-kill\n" in rollout


@pytest.mark.parametrize("flags, problem", [
    (["--rollout-spare-nodes", "-1"], "rollout.spare_nodes: must be 0 or more, got -1"),
    (["--rollout-spare-nodes", "1", "--colocate"], "rollout.spare_nodes: colocated engines run on the trainer's"),
    (["--rollout-spare-nodes", "4"], "rollout group: 5 nodes, but partition dev has 4"),
])
def test_bad_spare_nodes_are_refused(tmp_path: Path, flags: list[str], problem: str) -> None:
    with pytest.raises(SpecError) as err:
        prepare(None, job_flags(tmp_path, "spare") + flags, partitions=DEV)
    assert problem in str(err.value)
