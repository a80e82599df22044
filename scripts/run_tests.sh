#!/usr/bin/env bash
# Installs what the tests need and runs them. The devcluster is started by the tests (and stopped
# again, unless one was already running). Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
# The linter and the type checker first, over the product packages (pyproject.toml configures both;
# mypy's list of packages is its `packages`): a finding fails the run before the tests start.
python3 -m ruff check contract jobs supervisor trainer rollout ckpt_tools slurm slime
python3 -m mypy
# Three workers, each with a devcluster of its own (on CI's 2 cores: the devcluster tests mostly wait on
# their jobs; 29 min against 31-33 with two); the tests of one file that uses SLURM run in one worker
# (tests/conftest.py says why).
exec python3 -m pytest -ra -q --durations=15 -n "${TEST_WORKERS:-3}" --dist loadgroup "$@"
