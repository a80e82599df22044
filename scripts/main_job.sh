#!/usr/bin/env bash
# The main job: install, bring up the loopback SLURM devcluster, run a heterogeneous job whose
# steps report where they ran. Idempotent; the devcluster stays up (`slurmrl cluster down`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
slurmrl cluster up
eval "$(slurmrl cluster status | grep '^  export SLURM_CONF=')"
out=$(mktemp -d)/hello-hetjob.out
sbatch --wait --output="$out" examples/hello_hetjob.sbatch
cat "$out"
