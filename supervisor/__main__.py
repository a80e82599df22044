"""`python -m supervisor --job-dir DIR`: the supervisor of a plain-sbatch job (slurm/templates/),
reading DIR/spec.yaml; `slurmrl submit` runs the same Daemon through Submitit."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from contract.spec import SpecError
from contract.spec_loading import read_job_spec
from slurm.watchdog import watch_self


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m supervisor")
    parser.add_argument("--job-dir", required=True)
    args = parser.parse_args()
    code = watch_self()  # the batch shell (exec): the supervisor runs in its child, restarted after a crash
    if code is not None:
        return code
    # Imported in the child only: the watchdog stays small.
    from contract.job_dir import JobDir
    from supervisor.daemon import JobFailed, record_start_failure, start

    try:
        spec = read_job_spec(args.job_dir)
    except SpecError as err:
        record_start_failure(JobDir(Path(args.job_dir)), f"the job spec cannot be read: {err}")
        print(f"python -m supervisor: error: {err}", file=sys.stderr)
        return 2
    try:
        print(start(spec).run())
    except JobFailed as err:
        print(f"python -m supervisor: the job failed: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
