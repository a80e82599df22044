"""A --debug-train-only job (or one with --load-debug-rollout-data, which sets it, as in slime) asks
SLURM for the trainer's nodes only: one group, no `#SBATCH hetjob` rollout group, whatever the rollout
section says, which is then neither checked nor asked for (slime's placement group is the actor's GPUs
alone with debug_train_only)."""

from __future__ import annotations

from pathlib import Path

import pytest

from contract.spec import SpecError
from jobs.submit import prepare, render_script
from jobs.validate import PartitionInfo
from tests.jobs.helpers import job_flags

CPU_ONLY = {"dev": PartitionInfo("dev", nodes=3, cpus_per_node=8, gpus_per_node=0)}
# a rollout section no node of CPU_ONLY can hold: 16 GPUs of SGLang engines
GPU_ENGINES = ["--rollout-engine", "sglang", "--rollout-num-gpus", "16", "--rollout-num-gpus-per-node", "8"]
SFT = "slime.rollout.sft_rollout.generate_rollout"


@pytest.mark.parametrize("flags", [
    ["--debug-train-only", "--load-debug-rollout-data", "dump/{rollout_id}.pt"],
    ["--load-debug-rollout-data", "dump/{rollout_id}.pt"],
    ["--debug-train-only", "--rollout-function-path", SFT, "--loss-type", "sft_loss",
     "--disable-compute-advantages-and-returns"],
])
def test_a_debug_train_only_job_asks_for_the_trainer_nodes_alone(tmp_path: Path, flags: list[str]) -> None:
    spec = prepare(None, job_flags(tmp_path, "dto") + GPU_ENGINES + flags, partitions=CPU_ONLY)
    assert not spec.starts_engines and spec.het_groups == 1
    script = render_script(spec)
    header = script.split("\n\n# setup")[0] + "\n"
    assert "#SBATCH hetjob" not in header and "gres" not in header
    assert "#SBATCH --nodes=1\n" in header and "#SBATCH --ntasks-per-node=1\n" in header


def test_debug_train_only_set_in_the_custom_config_yaml_starts_no_engines_either(tmp_path: Path) -> None:
    config = tmp_path / "sft.yaml"  # --custom-config-path's keys are set on the trainer's flags
    config.write_text("debug_train_only: true\n")
    flags = ["--custom-config-path", str(config), "--rollout-function-path", SFT, "--loss-type", "sft_loss",
             "--disable-compute-advantages-and-returns"]
    spec = prepare(None, job_flags(tmp_path, "dto") + GPU_ENGINES + flags, partitions=CPU_ONLY)
    assert not spec.starts_engines and spec.het_groups == 1


def test_the_same_job_with_engines_asks_for_its_rollout_group(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="rollout group: 8 GPUs per node, but the nodes of partition dev have 0"):
        prepare(None, job_flags(tmp_path, "rl") + GPU_ENGINES, partitions=CPU_ONLY)
    spec = prepare(None, job_flags(tmp_path, "rl"), partitions=CPU_ONLY)
    assert spec.starts_engines and render_script(spec).count("#SBATCH hetjob") == 1


def test_train_async_with_colocate_is_refused_without_engines_too(tmp_path: Path) -> None:
    """slime's train_async.py asserts not --colocate: its SFT scripts (train_async.py --debug-train-only)
    run without it; with it the job is refused at submission, not failed at its trainer's start."""
    flags = ["--train-async", "--colocate", "--debug-train-only", "--rollout-function-path", SFT, "--loss-type",
             "sft_loss", "--disable-compute-advantages-and-returns"]
    with pytest.raises(SpecError, match="rollout.colocate: slime's train_async.py"):
        prepare(None, job_flags(tmp_path, "sft") + flags, partitions=CPU_ONLY)
    spec = prepare(None, job_flags(tmp_path, "sft") + [f for f in flags if f != "--colocate"], partitions=CPU_ONLY)
    assert spec.het_groups == 1
