#!/usr/bin/env bash
# Installs slurmrl and what its tests need into this machine's Python. Idempotent.
# (SLURM, munge and MariaDB come from apt-get, installed by `slurmrl cluster up` when missing.)
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
# The CPU build first: an unpinned torch would pull gigabytes of CUDA wheels.
python3 -m pip install -q torch==2.13.0
python3 -m pip install -q -e ".[dev]"
# SGLang's own argument parser (jobs/sglang_args.py checks engine command lines with it). SGLang
# cannot run here: the wheel, and the modules `sglang.srt.server_args` imports that slurmrl's own
# dependencies do not bring, go into a side folder with --no-deps, never site-packages (sglang's
# dependencies would replace torch and transformers); the check puts it after site-packages on
# sys.path, so it shadows nothing. 0.5.5.post3 is the newest SGLang whose server_args imports
# without torchvision (whose PyPI wheels need CUDA's libraries).
SGLANG_ARGS_PINS="sglang==0.5.5.post3 triton==3.4.0 pybase64==1.5.1 pyzmq==27.3.0 openai==3.54.0 \
partial-json-parser==0.2.1.1.post7 dill==0.4.1 sentencepiece==0.2.3 scipy==1.17.1 ipython==8.12.3 traitlets==5.15.0 \
pexpect==4.8.0 pickleshare==0.7.5 prompt-toolkit==3.0.52 ptyprocess==0.7.0 pure-eval==0.2.3 stack-data==0.6.3 \
wcwidth==0.7.0 asttokens==3.0.1 backcall==0.2.0 decorator==5.2.1 executing==2.2.1 pygments==2.20.0 sniffio==1.3.1"
if [ "$(cat .sglang-args/PINS 2>/dev/null)" != "$SGLANG_ARGS_PINS" ]; then
    rm -rf .sglang-args .sglang-args.tmp
    # shellcheck disable=SC2086
    python3 -m pip install -q --no-deps --target .sglang-args.tmp $SGLANG_ARGS_PINS
    echo "$SGLANG_ARGS_PINS" > .sglang-args.tmp/PINS
    mv .sglang-args.tmp .sglang-args
fi
# Chromium (Debian's), for the test that loads `slurmrl trace`'s page in a real headless browser.
if ! command -v chromium >/dev/null; then
    apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium
fi
# iproute2 (`ip`, `ss`), for the devcluster's network namespace per node and the tests that look inside one.
if ! command -v ip >/dev/null || ! command -v ss >/dev/null; then
    apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q iproute2
fi
# iptables, for `slurmrl cluster slow` (its NFQUEUE rules: the devcluster's kernel has no netem).
if ! command -v iptables >/dev/null; then
    apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q iptables
fi
