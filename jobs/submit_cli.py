"""`slurmrl submit [train.py | train_async.py] [job.yaml] [flags] [--dry-run] [--wait] [--json]`.

slime's script names pick the trainer's loop as slime's scripts do: train.py (the default)
generates, then trains; train_async.py (the trainer's --train-async) generates rollout N+1 while
rollout N trains.

Flags are the spec's own (`--actor-num-nodes`, `--rollout-engine`, `--time`, ...), `--sglang-*` and
`--router-*` passthroughs, and the trainer's (`python -m trainer --help`); they override the file.
The arguments are read here, not by argparse: trainer values such as `-1` or `1e-2` and repeated
flags must reach the spec exactly as typed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

OWN = ("--dry-run", "--wait", "--json")
# slime's entry scripts, and the trainer flags each stands for
SLIME_SCRIPTS = {"train.py": [], "train_async.py": ["--train-async"]}
USAGE = """usage: slurmrl submit [train.py | train_async.py] [JOB.yaml] [FLAGS...] [--dry-run] [--wait] [--json]

Submit an RL job as one heterogeneous SLURM job (group 0: trainer nodes and the supervisor,
group 1: rollout nodes). slime's script name picks the loop: train.py (default) or train_async.py
(rollout N+1 generated while rollout N trains; the trainer's --train-async). Flags override the YAML file:
  spec flags        {spec}
  --sglang-*        passed to every engine (--sglang-mem-fraction-static 0.8 -> --mem-fraction-static 0.8) and
                    checked by SGLang's own parser; slime's own --sglang-router-request-timeout-secs and
                    --sglang-server-concurrency go to the router and the trainer instead
  --router-*        passed to the sglang-router
  anything else     the trainer's flags (python -m trainer --help)
  --dry-run         validate and print the sbatch script; submit and write nothing
  --wait            follow the job to its end; exit 0 only if it COMPLETED
  --json            print {{"job_id": ..., "job_dir": ...}} as one JSON line
"""


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("submit", help="submit an RL job (a job spec YAML and/or flags) to SLURM",
                                   add_help=False)
    parser.add_argument("args", nargs=argparse.REMAINDER)
    parser.set_defaults(func=lambda args: main(args.args))


def _usage() -> str:
    from contract.spec_loading import spec_flags

    return USAGE.format(spec=" ".join(spec_flags()))


def main(argv: list[str]) -> int:
    if "-h" in argv or "--help" in argv:
        print(_usage())
        return 0
    own = {flag: flag in argv for flag in OWN}
    rest = [token for token in argv if token not in OWN]
    script: list[str] = []
    if rest and rest[0] in SLIME_SCRIPTS:
        script = SLIME_SCRIPTS[rest.pop(0)]
    spec_file = Path(rest.pop(0)) if rest and not rest[0].startswith("-") else None
    rest += script

    from contract.job_dir import JobDir
    from contract.spec import SpecError
    from jobs.follow import follow
    from jobs.submit import prepare, render_script, submit
    from slurm.client import SlurmUnavailable

    notes: list[str] = []
    try:
        spec = prepare(spec_file, rest, notes=notes)
    except SpecError as err:
        for problem in err.problems:
            print(f"slurmrl submit: error: {problem}", file=sys.stderr)
        return 2
    for note in notes:
        print(f"slurmrl submit: note: {note}", file=sys.stderr)
    if own["--dry-run"]:
        print(render_script(spec))
        return 0
    try:
        job = submit(spec)
    except SlurmUnavailable as err:  # no SLURM configuration here: the line names the fix
        print(f"slurmrl submit: error: {err}", file=sys.stderr)
        return 1
    except Exception as err:  # sbatch refused (the message is SLURM's own), or no SLURM at all
        print(f"slurmrl submit: error: submission failed: {err}".rstrip(), file=sys.stderr)
        return 1
    if own["--json"]:
        print(json.dumps({"job_id": job.job_id, "job_dir": spec.job_dir}), flush=True)
    else:
        print(f"submitted job {job.job_id}\njob dir: {spec.job_dir}", flush=True)
    if not own["--wait"]:
        return 0
    state = follow(job.job_id, JobDir(Path(spec.job_dir or "")), out=sys.stderr if own["--json"] else sys.stdout)
    if state != "COMPLETED":
        print(f"slurmrl submit: job {job.job_id} ended {state}; logs in {spec.job_dir}/submitit", file=sys.stderr)
        return 1
    return 0
