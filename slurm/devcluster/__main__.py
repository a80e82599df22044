"""`python -m slurm.devcluster up|down|status`, the same as `slurmrl cluster ...`."""

import sys

from jobs.cli import main

raise SystemExit(main(["cluster", *sys.argv[1:]]))
