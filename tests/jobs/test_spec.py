"""The job spec without SLURM: YAML + flags (flags win), the YAML round trip, finalize, and the
rendered heterogeneous sbatch script."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from contract.bounds import Bound
from contract.spec import FaultToleranceSpec, JobSpec, SpecError, flag_value, parse_slurm_time
from contract.spec_loading import finalize, load_spec, spec_from_yaml
from jobs.submit import prepare, render_script
from jobs.validate import PartitionInfo, validate
from tests.jobs.helpers import job_files, job_flags

YAML = """
name: toy
partition: dev
time: "00:30:00"
trainer:
  actor_num_gpus_per_node: 0
  cpus_per_task: 2
  train_args:
    hf-checkpoint: ${SLURMRL_TEST_MODEL}
    prompt-data: DATA
    num-rollout: 20
    lr: 1.0e-2
    rollout-shuffle: true
    rollout-top-k: -1
    n-samples-per-prompt: 4
rollout:
  engine: cpu
  num_engines: 2
  sglang_args: [--sglang-max-running-requests, "8"]
fault_tolerance:
  use_fault_tolerance: true
  rollout_health_check_interval: 2
"""
DEV = {"dev": PartitionInfo("dev", nodes=3, cpus_per_node=8, gpus_per_node=4)}


def _write(tmp_path: Path, text: str = YAML) -> Path:
    model, data = job_files(tmp_path)
    path = tmp_path / "job.yaml"
    path.write_text(text.replace("DATA", str(data)))
    return path


def test_yaml_then_flags_override(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURMRL_TEST_MODEL", str(tmp_path / "model"))
    spec, problems = load_spec(_write(tmp_path), ["--lr", "3e-3", "--actor-num-nodes", "2", "--colocate",
                                                  "--rollout-health-check-timeout", "7", "--sglang-dtype", "float32",
                                                  "--router-policy", "round_robin", "--save-interval", "5"])
    assert problems == []
    assert (spec.name, spec.time, spec.trainer.actor_num_nodes, spec.trainer.cpus_per_task) == ("toy", "00:30:00", 2, 2)
    assert spec.rollout.colocate is True and spec.rollout.num_engines == 2
    assert spec.fault_tolerance.use_fault_tolerance and spec.fault_tolerance.rollout_health_check_interval == 2.0
    assert spec.fault_tolerance.rollout_health_check_timeout == 7.0
    args = spec.trainer.train_args
    assert flag_value(args, "--lr") == "3e-3" and args.count("--lr") == 1, "the flag did not replace the file's"
    assert flag_value(args, "--hf-checkpoint") == str(tmp_path / "model"), "${VAR} was not expanded"
    assert flag_value(args, "--rollout-top-k") == "-1" and "--rollout-shuffle" in args
    assert flag_value(args, "--save-interval") == "5"
    assert spec.rollout.sglang_args == ["--sglang-max-running-requests", "8", "--sglang-dtype", "float32"]
    assert spec.rollout.router_args == ["--router-policy", "round_robin"]
    assert spec.trainer.num_rollout == 20


def test_colocated_engines_without_rollout_num_gpus_take_every_trainer_gpu(tmp_path: Path) -> None:
    """slime's rule: --colocate with no --rollout-num-gpus sizes the engines to the trainer's GPUs (nodes x GPUs
    per node); a count given as a flag, or in the spec file, stays."""
    trainer = ["--actor-num-nodes", "4", "--actor-num-gpus-per-node", "8"]
    assert load_spec(None, [*trainer, "--colocate"])[0].rollout.rollout_num_gpus == 32
    assert load_spec(None, [*trainer, "--colocate", "--rollout-num-gpus", "16"])[0].rollout.rollout_num_gpus == 16
    assert load_spec(None, trainer)[0].rollout.rollout_num_gpus == 8  # not colocated: the default
    (tmp_path / "job.yaml").write_text("rollout:\n  colocate: true\n  rollout_num_gpus: 16\n")
    spec, problems = load_spec(tmp_path / "job.yaml", trainer)
    assert problems == [] and spec.rollout.rollout_num_gpus == 16


def test_yaml_round_trip_and_finalize(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURMRL_TEST_MODEL", str(tmp_path / "model"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SLURMRL_JOBS_DIR", str(tmp_path / "jobs"))
    (tmp_path / "aime.jsonl").write_text('{"input": "1+1", "label": "2"}\n')
    spec = prepare(_write(tmp_path), ["--prompt-data", "toy.jsonl", "--eval-prompt-data", "aime", "aime.jsonl",
                                      "gsm", "toy.jsonl"], partitions=DEV)
    assert Path(spec.job_dir).is_absolute() and Path(spec.job_dir).parent == tmp_path / "jobs"
    assert re.fullmatch(r"toy-\d{8}-\d{6}", Path(spec.job_dir).name)
    assert not Path(spec.job_dir).exists(), "prepare wrote something"
    args = spec.trainer.train_args
    assert flag_value(args, "--prompt-data") == str(tmp_path / "toy.jsonl"), "a relative path was kept"
    evals = args[args.index("--eval-prompt-data") + 1:][:4]
    assert evals == ["aime", str(tmp_path / "aime.jsonl"), "gsm", str(tmp_path / "toy.jsonl")], evals
    assert flag_value(args, "--save") == flag_value(args, "--load") == spec.job_dir + "/checkpoints"
    assert spec.python
    again = spec_from_yaml(spec.to_yaml())
    assert again == spec
    assert spec_from_yaml(spec.write(tmp_path / "spec.yaml")) == spec
    assert finalize(again).trainer.train_args == args, "finalize is not idempotent"


def test_time_strings() -> None:
    cases = {"30": 30, "5:30": 6, "01:00:00": 60, "1-0": 1440, "2-03:04": 2 * 1440 + 184, "0-0:0:59": 1, 45: 45}
    assert {k: parse_slurm_time(k) for k in cases} == cases
    for bad in ("1h", "", "1:2:3:4", "-5", "1-", "UNLIMITED"):
        assert parse_slurm_time(bad) is None, bad


def test_yaml_problems_are_all_listed(tmp_path: Path) -> None:
    bad = "name: x\ntrainer: {actor_num_node: 2, cpus_per_task: lots}\nrollout: {engine: cpu, num_engine: 2}\nfoo: 1\n"
    with pytest.raises(SpecError) as err:
        spec_from_yaml(bad)
    text = "\n".join(err.value.problems)
    assert "trainer.actor_num_node: unknown field (did you mean actor_num_nodes?)" in text
    assert "trainer.cpus_per_task: 'lots' is not a valid int" in text
    assert "rollout.num_engine: unknown field (did you mean num_engines?)" in text
    assert "foo: unknown field" in text
    assert len(err.value.problems) == 4


def test_each_fault_tolerance_number_carries_its_unit_and_bounds() -> None:
    ft = FaultToleranceSpec()
    numbers = [f for f in dataclasses.fields(ft) if not isinstance(getattr(ft, f.name), bool)]
    assert len(numbers) == len(dataclasses.fields(ft)) - 1  # all but use_fault_tolerance
    assert all(isinstance(f.metadata.get("bound"), Bound) and f.metadata["bound"].unit in ("s", "count", "fraction")
               for f in numbers)
    spec = JobSpec()
    spec.fault_tolerance = dataclasses.replace(ft, preempt_grace=0, supervisor_gap=0.05, max_kill_fraction=0,
                                               max_requeues=-1, trainer_save_timeout=0.5)
    problems = [p for p in validate(spec, partitions=False) if p.startswith("fault_tolerance.")]
    assert problems == ["fault_tolerance.max_kill_fraction: must be in (0, 1], got 0",
                        "fault_tolerance.preempt_grace: must be 1 or more, got 0",
                        "fault_tolerance.max_requeues: must be 0 or more, got -1",
                        "fault_tolerance.trainer_save_timeout: must be 1 or more, got 0.5",
                        "fault_tolerance.supervisor_gap: must be 0.1 or more, got 0.05"]


def _groups(script: str) -> list[str]:
    header = script.split("\n\n# setup")[0] + "\n"
    return header.split("#SBATCH hetjob\n")


def test_rendered_script_has_two_het_groups(tmp_path: Path) -> None:
    flags = job_flags(tmp_path, "render") + ["--rollout-engine", "sglang", "--actor-num-gpus-per-node", "4",
                                             "--actor-num-nodes", "2", "--rollout-num-gpus", "8",
                                             "--rollout-num-gpus-per-engine", "2", "--rollout-num-gpus-per-node", "4",
                                             "--rollout-cpus-per-engine", "3", "--account", "acct", "--qos", "high",
                                             "--exclude", "node9"]
    spec = prepare(None, flags, partitions=DEV)
    script = render_script(spec)
    assert script.count("#SBATCH hetjob") == 1
    trainer, rollout = _groups(script)
    for line in ("--nodes=2", "--gres=gpu:4", "--ntasks-per-node=4", "--cpus-per-task=1", "--partition=dev",
                 "--time=10", "--account=acct", "--qos=high", "--exclude=node9", "--signal=B:USR1@60",
                 "--job-name=render", "--requeue", f"--output={spec.job_dir}/submitit/%j_0_log.out"):
        assert f"#SBATCH {line}\n" in trainer, line
    for line in ("--nodes=2", "--gres=gpu:4", "--ntasks-per-node=2", "--cpus-per-task=3", "--partition=dev",
                 "--time=10", "--account=acct"):
        assert f"#SBATCH {line}\n" in rollout, line
    assert "--signal" not in rollout and "--output" not in rollout
    assert f"\nexec {spec.python} -u -m jobs.hetjob {spec.job_dir}/submitit\n" in script
    assert "srun" not in script, "the callable must run in the batch step itself"
    assert not Path(spec.job_dir).exists()


def test_rendered_script_cpu_engines_and_colocate(tmp_path: Path) -> None:
    spec = prepare(None, job_flags(tmp_path, "cpu") + ["--rollout-engines-per-node", "1"], partitions=DEV)
    trainer, rollout = _groups(render_script(spec))
    assert "gres" not in trainer + rollout, "CPU-only groups asked for GPUs"
    assert "#SBATCH --nodes=2\n" in rollout and "#SBATCH --ntasks-per-node=1\n" in rollout
    colocated = prepare(None, job_flags(tmp_path, "colo", tmp_path / "job2") + ["--colocate"], partitions=DEV)
    script = render_script(colocated)
    assert "#SBATCH hetjob" not in script
    assert "#SBATCH --nodes=1\n" in script and "#SBATCH --ntasks-per-node=3\n" in script  # 1 worker + 2 engines
