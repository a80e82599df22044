#!/usr/bin/env bash
# Installs what the tests need and runs them. The devcluster is started by the tests (and stopped
# again, unless one was already running). Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
# Two workers: the tests that use SLURM run in one (they share the devcluster), the rest in the other.
exec python3 -m pytest -ra -q --durations=15 -n "${TEST_WORKERS:-2}" --dist loadgroup "$@"
