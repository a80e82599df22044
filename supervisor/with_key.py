"""`python -m supervisor.with_key MODULE ARGS...`: run `python -m MODULE ARGS... --api-key KEY` in
this process, KEY read from the environment. The key is never on a command line: not in what
srun records (squeue, sacct), and not in `ps` on the node, since it is added to sys.argv only
inside the process."""

from __future__ import annotations

import os
import runpy
import sys

from jobs.contract import API_KEY_ENV


def main() -> None:
    if len(sys.argv) < 2 or not os.environ.get(API_KEY_ENV):
        print(f"usage: {API_KEY_ENV}=KEY python -m supervisor.with_key MODULE [ARGS...]", file=sys.stderr)
        raise SystemExit(2)
    module = sys.argv[1]
    # One token: a key that starts with "-" must not read as another flag.
    sys.argv = [module, *sys.argv[2:], f"--api-key={os.environ[API_KEY_ENV]}"]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
