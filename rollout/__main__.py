"""`python -m rollout tiny-model ...`, the same as `slurmrl tiny-model ...`."""

import sys

from jobs.cli import main

raise SystemExit(main(sys.argv[1:]))
