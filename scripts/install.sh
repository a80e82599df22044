#!/usr/bin/env bash
# Installs slurmrl and what its tests need into this machine's Python. Idempotent.
# (SLURM, munge and MariaDB come from apt-get, installed by `slurmrl cluster up` when missing.)
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
# The CPU build first: an unpinned torch would pull gigabytes of CUDA wheels.
python3 -m pip install -q torch==2.13.0
python3 -m pip install -q -e ".[dev]"
