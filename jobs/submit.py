"""Submission of a job spec as one heterogeneous SLURM job through Submitit.

    spec = prepare(Path("job.yaml"), ["--num-rollout", "20"])   # SpecError lists every problem
    print(render_script(spec))                                  # the sbatch script; writes nothing
    job = submit(spec)                                          # job dir + spec.yaml + model files + sbatch
    state = follow(job.job_id, JobDir(Path(spec.job_dir)))     # jobs/follow.py: prints each change to the end

`submit` runs `fn()` in the batch step on the first node of het group 0; by default
fn = supervisor.daemon.Supervisor(spec) (a submitit.helpers.Checkpointable), called with no arguments.
"""

from __future__ import annotations

import contextlib
import io
import shlex
import shutil
import typing as tp
from pathlib import Path

from contract import step_options
from contract.job_dir import JOB_DIR_ENV, JobDir, keep_model_files, write_atomic
from contract.spec import JobSpec, SpecError
from contract.spec_loading import finalize, load_spec
from jobs.hetjob import HetSlurmExecutor, HetSlurmJob, het_groups
from jobs.validate import PartitionInfo, validate
from slurm.client import SlurmUnavailable
from slurm.configuration import configuration_problem


def prepare(yaml_path: Path | None, argv: list[str],
            partitions: dict[str, PartitionInfo] | None | bool = True, notes: list[str] | None = None) -> JobSpec:
    """The spec of a YAML file and flags, validated and finalized (absolute job dir and paths);
    raises SpecError with every problem. Writes nothing. notes: gets the checks that could not run."""
    spec, problems = load_spec(yaml_path, argv)
    problems += validate(spec, partitions, notes)
    if problems:
        raise SpecError(problems)
    final = finalize(spec)
    if notes is not None:
        notes += step_options.mount_notes(final)
    return final


def make_executor(spec: JobSpec, require_slurm: bool = True) -> HetSlurmExecutor:
    ft = spec.fault_tolerance
    executor = HetSlurmExecutor(JobDir(Path(spec.job_dir or ".")).submitit, het_groups(spec), python=spec.python,
                                max_num_timeout=ft.max_requeues, preempt_grace_s=ft.preempt_grace,
                                require_slurm=require_slurm)
    executor.update_parameters(job_name=spec.name, setup=[f"export {JOB_DIR_ENV}={shlex.quote(str(spec.job_dir))}"])
    return executor


def render_script(spec: JobSpec) -> str:
    """The sbatch script `submit` would send (SLURM need not be there; nothing is written)."""
    return make_executor(spec, require_slurm=False).render()


def submit(spec: JobSpec, fn: tp.Callable[[], tp.Any] | None = None) -> HetSlurmJob:
    """Create the job dir (spec.yaml, the model's config and tokenizer, submitit/), submit fn
    (default: the supervisor) as one heterogeneous job, and return Submitit's handle.
    SlurmUnavailable, before anything is written, where SLURM has no configuration here; a failed
    sbatch removes the job dir again (its error is in the exception, and printed by nothing else)."""
    if fn is None:
        from supervisor.daemon import Supervisor

        fn = Supervisor(spec)
    job_dir = Path(spec.job_dir or "")
    if not job_dir.is_absolute():
        raise ValueError("submit a finalized spec (jobs.submit.prepare or contract.spec_loading.finalize)")
    problem = configuration_problem()
    if problem is not None:
        raise SlurmUnavailable(problem)
    created = not job_dir.exists()
    job_dir.mkdir(parents=True, exist_ok=True)
    try:
        spec.write(JobDir(job_dir).spec)
        if spec.trainer.hf_checkpoint:  # its config and tokenizer, kept: the folder may go while the job runs
            keep_model_files(Path(spec.trainer.hf_checkpoint), JobDir(job_dir))
        # Submitit prints a failed sbatch's stderr before raising it in the exception: once is enough.
        with contextlib.redirect_stderr(io.StringIO()):
            job = make_executor(spec).submit(fn)
    except BaseException:
        if created:
            shutil.rmtree(job_dir, ignore_errors=True)
        raise
    write_atomic(JobDir(job_dir).slurm_job_id, f"{job.job_id}\n")
    return tp.cast(HetSlurmJob, job)
