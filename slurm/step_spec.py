"""What to run as one step of a job, and where; and the srun command line that runs it."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
SLURM_OWN_STEPS = ("batch", "extern")  # steps SLURM runs in every job itself


@dataclass(frozen=True)
class StepSpec:
    """What to run as one step, and where."""

    name: str  # srun --job-name; unique among the job's live steps (engine-3, router, trainer)
    argv: tuple[str, ...]
    nodes: tuple[str, ...]
    log: Path
    het_group: int | None = None  # None for a job that is not heterogeneous
    ntasks: int = 1
    gpus_per_node: int = 0
    cpus_per_task: int | None = None
    overlap: bool = False  # share CPUs/GPUs already held by other steps (e.g. --colocate)
    workdir: str | None = None  # srun --chdir; default: the supervisor's
    env: Mapping[str, str] | None = None  # the step's whole environment; default: ours
    options: tuple[str, ...] = ()  # more srun options: Pyxis's and the role's own (contract/step_options.py)
    piped: bool = False  # its stdout comes back through srun's and srun's stdin reaches it (a channel); stderr to log

    def __post_init__(self) -> None:
        if not _NAME.fullmatch(self.name) or self.name in SLURM_OWN_STEPS:
            raise ValueError(f"step name {self.name!r}: use letters, digits, '_', '.', '-'; not batch/extern")
        if not self.nodes or not self.argv:
            raise ValueError(f"step {self.name!r} needs nodes and a command")


def srun_argv(job_id: str, spec: StepSpec) -> list[str]:
    argv = ["srun", f"--jobid={job_id}"]
    if spec.het_group is not None:
        argv.append(f"--het-group={spec.het_group}")
    argv += [f"--nodelist={','.join(spec.nodes)}", f"--nodes={len(spec.nodes)}", f"--ntasks={spec.ntasks}",
             # Without --exact a step takes every CPU its job holds on the node and the next
             # step waits ("Requested nodes are busy"); without a GPU count it takes every GPU.
             "--exact",
             f"--gpus-per-node={spec.gpus_per_node}" if spec.gpus_per_node else "--gres=none"]
    if spec.cpus_per_task is not None:
        argv.append(f"--cpus-per-task={spec.cpus_per_task}")
    if spec.overlap:
        argv.append("--overlap")
    if spec.workdir:
        argv.append(f"--chdir={spec.workdir}")
    # Append: a relaunched step keeps its predecessor's last words in the same log.
    output = f"--error={spec.log}" if spec.piped else f"--output={spec.log}"
    argv += [f"--job-name={spec.name}", output, "--open-mode=append",
             "--kill-on-bad-exit=1", *spec.options, *spec.argv]
    return argv
