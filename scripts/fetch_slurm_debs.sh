#!/usr/bin/env bash
# Download Debian's SLURM 22.05 and munge packages, and the libraries a minimal Ubuntu image lacks,
# into DIR (default .debs/, git-ignored): what `slurmrl cluster up --debs DIR --no-accounting` runs
# from on a machine whose apt-get reaches no registry (the GPU machine). Run it where apt-get works
# (a Debian 12 machine: these are bookworm's packages), then carry DIR over. About 5 MB.
# Idempotent: packages already in DIR are not fetched again.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-.debs}
packages=(
    slurmd slurmctld slurm-client slurm-wlm-basic-plugins munge libmunge2
    # seen missing on the GPU machine (Ubuntu 24.04): reference/slurm-devcluster.md
    libhwloc15 libjson-c5 liblua5.1-0 libnuma1 libyaml-0-2 liblz4-1 libreadline8 libdbus-1-3 libgcrypt20
    libgpg-error0
)
mkdir -p "$dir"
cd "$dir"
missing=()
for package in "${packages[@]}"; do
    compgen -G "${package}_*.deb" >/dev/null || missing+=("$package")
done
if [ ${#missing[@]} -gt 0 ]; then
    # apt-get download fetches the candidate versions; a stale package list is refreshed once.
    apt-get download "${missing[@]}" 2>/dev/null || { apt-get update -qq && apt-get download "${missing[@]}"; }
fi
ls -1 ./*.deb
du -sh .
