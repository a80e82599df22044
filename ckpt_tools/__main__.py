"""`python -m ckpt_tools ...`, the same as `slurmrl ckpt ...`."""

import sys

from jobs.cli import main

raise SystemExit(main(["ckpt", *sys.argv[1:]]))
