"""`python -m supervisor.with_key MODULE ARGS...`: run `python -m MODULE ARGS... --api-key KEY` in
this process, KEY read from the environment. The key is never on a command line: not in what
srun records (squeue, sacct), and not in `ps` on the node, since it is added to sys.argv only
inside the process."""

from __future__ import annotations

import os
import runpy
import subprocess
import sys

from contract.job_dir import API_KEY_ENV


def main() -> None:
    if len(sys.argv) < 2 or not os.environ.get(API_KEY_ENV):
        print(f"usage: {API_KEY_ENV}=KEY python -m supervisor.with_key MODULE [ARGS...]", file=sys.stderr)
        raise SystemExit(2)
    module = sys.argv[1]
    if module.startswith("sglang_router"):
        plain_output()
    # One token: a key that starts with "-" must not read as another flag.
    sys.argv = [module, *sys.argv[2:], f"--api-key={os.environ[API_KEY_ENV]}"]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


# GNU sed, unbuffered: drops colour codes as each line passes.
_DROP_COLOUR = ["sed", "-u", r"s/\x1b\[[0-9;]*m//g"]


def plain_output() -> subprocess.Popen[bytes]:
    """sglang-router (Rust) colours its log even into a file: route this process's stdout and
    stderr through a filter process that drops the colour codes on their way to the step's log. A
    process, not a thread: the router holds the GIL while it serves. It ends when this one does."""
    read_end, write_end = os.pipe()
    pump = subprocess.Popen(_DROP_COLOUR, stdin=read_end, stdout=os.dup(1), stderr=subprocess.DEVNULL)
    os.close(read_end)
    os.dup2(write_end, 1)
    os.dup2(write_end, 2)
    os.close(write_end)
    return pump


if __name__ == "__main__":
    main()
