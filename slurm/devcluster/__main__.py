"""`python -m slurm.devcluster up|down|status ...`: slurm/devcluster/cli.py."""

from slurm.devcluster.cli import main

raise SystemExit(main())
