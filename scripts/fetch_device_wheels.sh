#!/usr/bin/env bash
# Download the Python packages the GPU machine lacks (its image has torch, transformers, pytest,
# aiohttp, ...: /work/.library/device/KINDS.md) as wheels for its Python 3.12, into DIR (default
# .whl/, git-ignored): scripts/gpu_*.sh install them from there. Run it where pip reaches an index,
# then carry DIR over (about 20 MB). Idempotent: wheels already in DIR are not fetched again.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-.whl}
packages=(
    megatron-core==0.16.1 sglang-router==0.3.2 setproctitle orjson
    fastapi starlette pydantic pydantic-core annotated-types typing-inspection typing-extensions
    opentelemetry-api importlib-metadata uvicorn submitit
    flash-linear-attention==0.6.0 fla-core==0.6.0 einops  # Qwen3-Next's gated delta rule (--qwen-gdn-backend fla)
)
platforms=()
for n in 17 27 28 31 34 35; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
mkdir -p "$dir"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" --platform manylinux2014_x86_64 -d "$dir" "${packages[@]}"
# pylatexenc (slime's math reward) is published as a source archive only: a pure-Python wheel is built.
compgen -G "$dir/pylatexenc-*.whl" >/dev/null || python3 -m pip wheel -q --no-deps -w "$dir" pylatexenc==2.10
ls -1 "$dir"
du -sh "$dir"
