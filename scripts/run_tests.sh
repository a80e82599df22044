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
# Two workers, each with a devcluster of its own; the tests of one file that uses SLURM run in one
# worker (tests/conftest.py says why). Three took 29 min on CI's 2 cores against 31-33, but loaded them so
# that test_deadline's supervisor misjudged a save's time once in two runs.
exec python3 -m pytest -ra -q --durations=15 -n "${TEST_WORKERS:-2}" --dist loadgroup "$@"
