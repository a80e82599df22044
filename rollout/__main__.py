"""`python -m rollout tiny-model | toy-data ...`: rollout/cli.py."""

from rollout.cli import main

raise SystemExit(main())
