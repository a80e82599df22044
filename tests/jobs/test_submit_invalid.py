"""Invariant 7 through `slurmrl submit`: each bad spec gets its one-line error naming the field and
the fix, exits non-zero, and creates nothing (no job dir, no SLURM job). The partition checks ask
the devcluster's sinfo (partition dev: 4 nodes x 4 GPUs x 8 CPUs)."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from jobs import cli
from slurm.devcluster import DevCluster
from tests.jobs.helpers import job_flags
from tests.slurm_helpers import slurm

pytestmark = pytest.mark.integration

CASES = {
    "gpus-not-multiple": (["--rollout-engine", "sglang", "--rollout-num-gpus", "3",
                           "--rollout-num-gpus-per-engine", "2"],
                          "rollout.rollout_num_gpus: 3 is not a multiple of rollout_num_gpus_per_engine 2"),
    "no-config-json": (["--hf-checkpoint", "/nonexistent/model"],
                       "--hf-checkpoint /nonexistent/model: no config.json there"),
    "no-prompt-data": (["--prompt-data", "/nonexistent/toy.jsonl"],
                       "--prompt-data /nonexistent/toy.jsonl: no such file"),
    "no-ref-load": (["--ref-load", "/nonexistent/ref"], "--ref-load /nonexistent/ref: no such folder"),
    "no-load": (["--load", "/nonexistent/load"], "--load /nonexistent/load: no such folder"),
    "unknown-trainer-flag": (["--lrr", "1e-2"], "unknown flag --lrr (did you mean --lr?)"),
    "unknown-spec-flag": (["--rollout-num-gpu", "4"],
                          "unknown flag --rollout-num-gpu (did you mean --rollout-num-gpus?)"),
    "too-many-nodes": (["--actor-num-nodes", "5"], "trainer group: 5 nodes, but partition dev has 4"),
    "too-many-gpus": (["--actor-num-gpus-per-node", "8"], "trainer group: 8 GPUs per node, but the nodes of partition "
                                                           "dev have 4"),
    "too-many-cpus": (["--rollout-cpus-per-engine", "6"], "rollout group: 2 tasks x 6 CPUs = 12 CPUs per node"),
    "colocate-sizes": (["--rollout-engine", "sglang", "--colocate", "--rollout-num-gpus", "4",
                        "--actor-num-gpus-per-node", "2"], "rollout.colocate: rollout_num_gpus 4 != actor_num_nodes x"),
    "bad-time": (["--time", "1h"], "time: '1h' is not a SLURM time"),
    "grace-too-long": (["--preempt-grace", "900"], "fault_tolerance.preempt_grace: 900 s is not shorter than"),
    "bad-partition": (["--partition", "nope"],
                      "partition: 'nope' is not a partition of this cluster (sinfo lists: dev)"),
    "owned-sglang-flag": (["--sglang-port", "1234"], "--sglang-port is set by slurmrl itself"),
    "owned-trainer-flag": (["--supervised"],
                           "train_args: --supervised is set by slurmrl itself"),
    "bad-engine": (["--rollout-engine", "vllm"], "rollout.engine: 'vllm' is not one of sglang, cpu"),
    "bad-int": (["--actor-num-nodes", "two"], "--actor-num-nodes: 'two' is not a valid int"),
    "bad-mount": (["--container-image", "img:1", "--container-mounts", "/data"],
                  "steps.container_mounts: '/data' not SRC:DST[:FLAGS]"),
    "empty-image": (["--engine-container-image", ""], "steps.engine_container_image: empty; give an image"),
    "owned-srun-option": (["--trainer-srun-args=--cpu-bind=none --nodelist=node1 -N 1"],
                          "steps.trainer_srun_args: --nodelist=node1, -N set by slurmrl itself"),
}


def _no_job_named(name: str) -> bool:
    queued = slurm("squeue", "-h", "-n", name, "-o", "%i").strip()
    recorded = slurm("sacct", "-n", "-X", "-S", "2020-01-01", "--name", name, "-o", "JobID").strip()
    return not queued and not recorded


def _submit(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    rc = cli.main(["submit", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("case", list(CASES))
def test_invalid_spec_is_refused_and_creates_nothing(case: str, devcluster: DevCluster, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    flags, message = CASES[case]
    name = f"bad-{uuid.uuid4().hex[:8]}"
    job_dir = tmp_path / "job"
    rc, out, err = _submit(job_flags(tmp_path, name, job_dir) + flags, capsys)
    assert rc == 2
    assert message in err, err
    assert all(line.startswith("slurmrl submit: error: ") for line in err.splitlines()), err
    assert not job_dir.exists() and not (tmp_path / "slurmrl-jobs").exists()
    assert _no_job_named(name)


def test_every_problem_is_listed_at_once(devcluster: DevCluster, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SLURMRL_NOT_SET", raising=False)
    spec_file = tmp_path / "job.yaml"
    spec_file.write_text("rollout: {num_engine: 2}\n"
                         "trainer:\n  train_args:\n    - --ref-load\n    - ${SLURMRL_NOT_SET}\n")
    flags = job_flags(tmp_path, f"bad-{uuid.uuid4().hex[:8]}") + ["--time", "1h", "--lrr", "1", "--sglang-host", "x"]
    rc, out, err = _submit([str(spec_file), *flags], capsys)
    assert rc == 2
    for message in ("rollout.num_engine: unknown field (did you mean num_engines?)", "${SLURMRL_NOT_SET} is not set",
                    "time: '1h' is not a SLURM time", "unknown flag --lrr (did you mean --lr?)",
                    "--sglang-host is set by slurmrl itself"):
        assert message in err, err
    assert not (tmp_path / "job").exists()


def test_existing_job_dir_is_not_reused(devcluster: DevCluster, tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    (job_dir / "state.json").write_text("{}")
    name = f"bad-{uuid.uuid4().hex[:8]}"
    rc, out, err = _submit(job_flags(tmp_path, name, job_dir), capsys)
    assert rc == 2 and "job_dir: " in err and "already exists and is not empty" in err
    assert [p.name for p in job_dir.iterdir()] == ["state.json"]
    assert _no_job_named(name)


def test_dry_run_prints_the_script_and_creates_nothing(devcluster: DevCluster, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    name = f"dry-{uuid.uuid4().hex[:8]}"
    rc, out, err = _submit(job_flags(tmp_path, name) + ["--dry-run"], capsys)
    assert rc == 0, err
    assert out.startswith("#!/bin/bash") and "#SBATCH hetjob" in out and f"--job-name={name}" in out
    assert not (tmp_path / "job").exists()
    assert _no_job_named(name)
