"""`python -m ckpt_tools hf-to-torch-dist | torch-dist-to-hf | inspect | verify ...`: ckpt_tools/cli.py."""

from ckpt_tools.cli import main

raise SystemExit(main())
