"""Heterogeneous SLURM jobs through Submitit (which has none: its issue 1741).

HetSlurmExecutor renders ONE sbatch script whose `#SBATCH hetjob` lines separate the groups:

    #SBATCH --nodes=1 --gres=gpu:8 ... (group 0, from Submitit's own _make_sbatch_string: its
    #SBATCH hetjob                      --output/--error paths, --open-mode, --signal, --wckey)
    #SBATCH --nodes=2 --gres=gpu:8 ... (group 1, ...)
    export SUBMITIT_EXECUTOR=slurm
    exec PYTHON -u -m jobs.hetjob FOLDER

and keeps the rest of Submitit: the callable and its arguments are pickled into FOLDER, the batch
step runs them (on the first node of group 0) through submitit's process_job, which writes the
result pickle; the handle is a Submitit Job (job.job_id, job.result(), job.state, job.stdout());
a helpers.Checkpointable is checkpointed and requeued on Submitit's USR2.

Decisions:
- The callable runs in the batch step itself (Submitit's use_srun=False), not in an srun step:
  it launches the job's steps with srun, and the batch step holds no step resources. `exec` makes
  the Python process the batch shell, so `--signal=B:...` (which reaches the batch shell only)
  reaches it, and no bash sits between SLURM and it. That process is a watchdog
  (slurm.watchdog): Submitit's worker, hence the callable, runs in its child, which gets the
  signals forwarded and is started again if it crashes (SLURM would end the job with the batch
  step's main process).
- sbatch honours one --signal. Submitit asks for `--signal=USR2@90` (without B:, i.e. to the job
  steps, where its srun'd worker lives); here that would signal the engines and the trainer, not
  the callable. We ask instead for `--signal=B:USR1@<preempt_grace>`: USR1, to the batch step
  (the callable), preempt_grace seconds before the time limit. Submitit's own handler stays on
  USR2 (`scancel -b --signal=USR2 JOB` still checkpoints and requeues, as does a callable sending
  itself USR2). Until the callable installs its own USR1 handler (issue 7: save now, then
  requeue), USR1 is forwarded to Submitit's USR2 handler, so a callable that does nothing about
  USR1 is checkpointed and requeued instead of being killed by USR1's default action.
- `--no-kill` in every group: a node that fails does not end the job (the supervisor relaunches
  its engines on a spare node, or goes on with fewer). Seen on slurm 22.05 with --no-kill: once
  the node is DOWN, a hetjob is still requeued (NODE_FAIL; killed if not requeueable), because
  the leader component counts as being on every node of every component and has a single node;
  a job without het groups keeps running without the node. So the supervisor releases a failed
  node from its component first (supervisor/nodes.py), while SLURM still calls it only
  NOT_RESPONDING: then the DOWN touches no job.
- Job state: sacct lists a hetjob as JOBID+0, JOBID+1 (briefly just JOBID while the components
  are recorded); Submitit's watcher knows neither, and would report UNKNOWN forever. HetInfoWatcher
  reports component 0's state (where the batch step, hence the callable, runs) as the job's. Where
  the accounting does not answer (a cluster without slurmdbd: Submitit's state would stay UNKNOWN),
  it reads squeue instead, which lists an ended job too until SLURM's MinJobAge.
"""

from __future__ import annotations

import os
import shlex
import signal
import sys
import time
import typing as tp
from dataclasses import dataclass
from pathlib import Path

from submitit.core import core, job_environment
from submitit.slurm import slurm as submitit_slurm

from contract.spec import JobSpec
from slurm.client import SlurmClient
from slurm.watchdog import watch_self

PREEMPT_SIGNAL = "USR1"


@dataclass(frozen=True)
class HetGroup:
    """The resources of one het group (one `#SBATCH hetjob` component)."""

    nodes: int
    ntasks_per_node: int = 1
    cpus_per_task: int = 1
    gpus_per_node: int = 0
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    time_min: int | None = None
    exclude: str | None = None

    def sbatch_options(self) -> dict[str, tp.Any]:
        """Submitit's parameter names (as its _make_sbatch_string takes them); None: not given."""
        options = {"nodes": self.nodes, "ntasks_per_node": self.ntasks_per_node, "cpus_per_task": self.cpus_per_task,
                   "gres": f"gpu:{self.gpus_per_node}" if self.gpus_per_node > 0 else None,
                   "partition": self.partition, "account": self.account, "qos": self.qos, "time": self.time_min,
                   "exclude": self.exclude}
        return {k: v for k, v in options.items() if v is not None}

    def sbatch_lines(self) -> list[str]:
        options = {**self.sbatch_options(), "no_kill": True}
        return [submitit_slurm._as_sbatch_flag(k, v) for k, v in sorted(options.items())]


def het_groups(spec: JobSpec) -> list[HetGroup]:
    """The het groups to ask SLURM for: 0 = trainer nodes (the batch step, i.e. the supervisor,
    runs on its first node), 1 = rollout nodes (absent with --colocate: the engines share
    group 0's nodes and GPUs, their tasks added to group 0's; absent with --debug-train-only,
    which starts no engines)."""
    t, r = spec.trainer, spec.rollout

    def group(nodes: int, ntasks_per_node: int, cpus_per_task: int, gpus_per_node: int) -> HetGroup:
        return HetGroup(nodes=nodes, ntasks_per_node=ntasks_per_node, cpus_per_task=cpus_per_task,
                        gpus_per_node=gpus_per_node, partition=spec.partition, account=spec.account, qos=spec.qos,
                        time_min=spec.time_minutes, exclude=spec.exclude)

    if not spec.starts_engines:
        return [group(t.actor_num_nodes, t.tasks_per_node, t.cpus_per_task, t.actor_num_gpus_per_node)]
    if r.colocate:
        per_node = -(-r.engine_count // max(1, t.actor_num_nodes))
        cpus = max(t.cpus_per_task, r.cpus_per_engine)
        return [group(t.actor_num_nodes, t.tasks_per_node + per_node, cpus, t.actor_num_gpus_per_node)]
    return [group(t.actor_num_nodes, t.tasks_per_node, t.cpus_per_task, t.actor_num_gpus_per_node),
            group(r.num_nodes + r.spare_nodes, r.engines_on_each_node, r.cpus_per_engine, r.gpus_per_node)]


class HetInfoWatcher(submitit_slurm.SlurmInfoWatcher):
    """Submitit's sacct watcher, reading JOBID+K rows: the job's state is component 0's; squeue's
    rows where sacct does not answer. SLURM's programs run through slurmrl's client."""

    def update(self) -> None:
        """Submitit's update (one sacct call for every job not finished), with squeue's view of the
        jobs when the accounting does not answer."""
        command = self._make_command()
        if command is None:
            return
        self._num_calls += 1
        client = SlurmClient()
        accounted = client.call(*command)
        if accounted.ok:
            self._info_dict.update(self.read_info(accounted.stdout))
        else:
            job_ids = [word for flag, word in zip(command, command[1:]) if flag == "-j"]
            queued = client.call("squeue", "-h", "-t", "all", "-j", ",".join(job_ids), "-o", "%i|%T|%N")
            if queued.ok:
                self._info_dict.update(self.read_info("JobID|State|NodeList\n" + queued.stdout))
        self._last_status_check = time.time()
        for job_id in self._registered - self._finished:
            if self.is_done(job_id, mode="cache"):
                self._finished.add(job_id)

    def read_info(self, string: bytes | str) -> dict[str, dict[str, str]]:
        text = string.decode() if isinstance(string, bytes) else string
        lines = text.splitlines()
        if len(lines) < 2:
            return {}
        names = lines[0].split("|")
        out: dict[str, dict[str, str]] = {}
        for line in lines[1:]:
            stats = {x: y.strip() for x, y in zip(names, line.split("|"))}
            job_id = stats.get("JobID", "")
            if not job_id or "." in job_id:
                continue
            main, _, component = job_id.partition("+")
            out[job_id] = stats
            if component in ("", "0"):
                out[main] = stats
        return out


class HetSlurmJob(submitit_slurm.SlurmJob[tp.Any]):
    watcher = HetInfoWatcher(delay_s=60)

    def components(self, mode: str = "force") -> dict[str, str]:
        """{"JOBID+0": state, "JOBID+1": state} as sacct last showed them."""
        self.watcher.get_info(self.job_id, mode=mode)
        prefix = f"{self.job_id}+"
        return {k: v.get("State", "UNKNOWN") for k, v in self.watcher._info_dict.items() if k.startswith(prefix)}


class HetSlurmExecutor(submitit_slurm.SlurmExecutor):
    """Submitit's SLURM executor for one heterogeneous job. `groups[0]` holds the batch step; its
    resources and the job-wide settings (job_name, time, setup, ...) come from update_parameters as
    with SlurmExecutor; `groups[1:]` are appended after `#SBATCH hetjob` lines."""

    job_class = HetSlurmJob

    def __init__(self, folder: str | Path, groups: list[HetGroup], python: str | None = None,
                 max_num_timeout: int = 3, preempt_grace_s: int = 600, require_slurm: bool = True) -> None:
        # SlurmExecutor.__init__ refuses to exist without srun; a dry run renders without SLURM.
        core.PicklingExecutor.__init__(self, folder, max_num_timeout=max_num_timeout)
        self.python = shlex.quote(python or sys.executable)
        if require_slurm and not self.affinity() > 0:
            raise RuntimeError('Could not detect "srun", are you indeed on a slurm cluster?')
        if not groups:
            raise ValueError("a heterogeneous job needs at least one group")
        self.groups = list(groups)
        self.update_parameters(**groups[0].sbatch_options(), use_srun=False,
                               additional_parameters={"signal": f"B:{PREEMPT_SIGNAL}@{int(preempt_grace_s)}",
                                                      "requeue": True, "no_kill": True,
                                                      # SLURM writes slurm_job_N_resize.sh into the job's
                                                      # work dir when a lost node is released: not the user's
                                                      # cwd (the steps still run there: SLURM_SUBMIT_DIR).
                                                      "chdir": str(self.folder)})

    def _internal_update_parameters(self, **kwargs: tp.Any) -> None:
        if kwargs.get("use_srun"):
            raise ValueError("HetSlurmExecutor runs the callable in the batch step (use_srun=False)")
        if kwargs.get("teardown"):
            raise ValueError("HetSlurmExecutor execs the callable: teardown lines would never run")
        extra = kwargs.get("additional_parameters")
        if extra is not None and "signal" not in extra:  # keep our B:USR1 unless replaced on purpose
            kwargs["additional_parameters"] = {**self.parameters.get("additional_parameters", {}), **extra}
        super()._internal_update_parameters(**kwargs)

    @property
    def _submitit_command_str(self) -> str:
        return " ".join(["exec", self.python, "-u -m jobs.hetjob", shlex.quote(str(self.folder))])

    def _num_tasks(self) -> int:
        return 1  # the batch step is the one task that writes a result

    def _internal_process_submissions(self, delayed_submissions: list[tp.Any]) -> list[core.Job[tp.Any]]:
        if len(delayed_submissions) != 1:
            raise ValueError("HetSlurmExecutor submits one job at a time (no arrays)")
        return super()._internal_process_submissions(delayed_submissions)

    def _make_submission_file_text(self, command: str, uid: str) -> str:
        text = super()._make_submission_file_text(command, uid)
        lines = text.split("\n")
        last = max(i for i, line in enumerate(lines) if line.startswith("#SBATCH"))
        het: list[str] = []
        for k, group in enumerate(self.groups[1:], start=1):
            het += ["#SBATCH hetjob", f"# het group {k}", *group.sbatch_lines()]
        return "\n".join([*lines[:last + 1], *het, *lines[last + 1:]])

    def render(self) -> str:
        """The sbatch script a submission would send (writes nothing)."""
        return self._make_submission_file_text(self._submitit_command_str, "dry-run")


def _forward_to_submitit(signum: int, frame: tp.Any) -> None:
    """Default USR1 handler: Submitit's checkpoint-and-requeue (its handler on USR2)."""
    handler = signal.getsignal(job_environment.JobEnvironment._usr_sig())
    if callable(handler):
        handler(signum, frame)


def main(argv: list[str]) -> None:
    """The batch step: `python -m jobs.hetjob FOLDER`, a watchdog whose child (restarted if it
    crashes) is Submitit's worker with USR1 forwarded."""
    code = watch_self()
    if code is not None:
        sys.exit(code)
    signal.signal(getattr(signal, "SIG" + PREEMPT_SIGNAL), _forward_to_submitit)
    sys.argv = [sys.argv[0], *argv]
    from submitit.core.submission import submitit_main

    submitit_main()


if __name__ == "__main__":
    os.environ.setdefault("SUBMITIT_EXECUTOR", "slurm")
    main(sys.argv[1:])
