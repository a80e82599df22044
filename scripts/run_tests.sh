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
# Two workers: the tests that use SLURM run in one (they share the devcluster), the rest in the other.
exec python3 -m pytest -ra -q --durations=15 -n "${TEST_WORKERS:-2}" --dist loadgroup "$@"
