"""The plain-sbatch templates: sbatch accepts them, and the toy one asks for what `slurmrl submit`
renders for examples/toy_job.yaml."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from contract.spec_loading import read_job_spec
from jobs.submit import prepare, render_script
from jobs.validate import PartitionInfo
from slurm.devcluster import DevCluster
from tests.jobs.helpers import job_files
from tests.slurm_helpers import slurm

ROOT = Path(__file__).resolve().parents[2]
TEMPLATES = ROOT / "slurm" / "templates"
DEV = {"dev": PartitionInfo("dev", nodes=3, cpus_per_node=8, gpus_per_node=4)}
GROUP_KEYS = ("nodes", "ntasks-per-node", "cpus-per-task", "gres", "partition")


def _groups(script: str) -> list[dict[str, str]]:
    """{option: value} of each het group's #SBATCH lines (several options on a line allowed)."""
    groups: list[dict[str, str]] = [{}]
    for line in script.splitlines():
        if line.strip() == "#SBATCH hetjob":
            groups.append({})
        elif line.startswith("#SBATCH "):
            for key, value in re.findall(r"--([\w-]+)=(\S+)", line):
                if key in GROUP_KEYS:
                    groups[-1][key] = value
    return groups


def test_toy_template_matches_the_toy_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, data = job_files(tmp_path)
    monkeypatch.setenv("SLURMRL_TINY_MODEL", str(model))
    monkeypatch.setenv("SLURMRL_TOY_DATA", str(data))
    spec = prepare(ROOT / "examples" / "toy_job.yaml", ["--job-dir", str(tmp_path / "job")], partitions=DEV)
    assert _groups((TEMPLATES / "toy_devcluster.sbatch").read_text()) == _groups(render_script(spec))
    # A template's job dir: the YAML copied in as is; the supervisor's reading expands and finalizes it.
    job_dir = tmp_path / "plain"
    job_dir.mkdir()
    (job_dir / "spec.yaml").write_text((ROOT / "examples" / "toy_job.yaml").read_text())
    read = read_job_spec(job_dir)
    assert read.job_dir == str(job_dir) and read.trainer.hf_checkpoint == str(model)
    assert read.trainer.save == str(job_dir / "checkpoints")


@pytest.mark.integration
def test_sbatch_accepts_the_templates(devcluster: DevCluster, tmp_path: Path) -> None:
    for template in sorted(TEMPLATES.glob("*.sbatch")):
        text = template.read_text()
        # The production templates name a partition "gpu" with 8-GPU nodes; the devcluster has dev, 4.
        text = text.replace("partition=gpu", "partition=dev").replace("gpu:8", "gpu:4")
        text = re.sub(r"--ntasks-per-node=\d+ --cpus-per-task=\d+", "--ntasks-per-node=1 --cpus-per-task=1", text)
        path = tmp_path / template.name
        path.write_text(text)
        slurm("sbatch", "--test-only", str(path))  # asserts it exits 0; submits nothing
