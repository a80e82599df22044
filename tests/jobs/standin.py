"""Stand-ins for the supervisor that the tests submit (pickled by value: workers need not import
this module)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import submitit


class ReportEnv(submitit.helpers.Checkpointable):
    """Built like the supervisor (from the spec), called with no arguments: writes the SLURM
    environment it sees (both het groups' node lists among it) to env.json in the job dir, and
    returns the group node lists. With fail=True it raises instead."""

    def __init__(self, spec: Any, fail: bool = False) -> None:
        self.job_dir = spec.job_dir
        self.fail = fail

    def __call__(self) -> dict[str, str]:
        if self.fail:
            raise RuntimeError("the stand-in supervisor failed on purpose")
        env = {k: v for k, v in os.environ.items() if k.startswith(("SLURM", "SUBMITIT", "SLURMRL"))}
        env["pid"], env["ppid"] = str(os.getpid()), str(os.getppid())
        Path(self.job_dir, "env.json").write_text(json.dumps(env, indent=1))
        return {k: env.get(k, "") for k in ("SLURM_JOB_NODELIST_HET_GROUP_0", "SLURM_JOB_NODELIST_HET_GROUP_1",
                                            "SLURMD_NODENAME")}

