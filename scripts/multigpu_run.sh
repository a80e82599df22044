#!/usr/bin/env bash
# Issue 19's device run on a machine of 2+ GPUs (`run(kind="nvidia-h200-x2", command="bash
# scripts/multigpu_run.sh", carry=[".whl"], timeout_s=560)`): bench/bench_multi_gpu.py, then tests/gpu;
# logs under $OUT. NVLink multicast stays off (the device's KINDS.md says why).
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/multigpu}
mkdir -p "$OUT"
nvidia-smi -L; nvidia-smi topo -m | head -4
began=$SECONDS
timeout -s INT -k 10 "${BENCH_LIMIT:-320}" python3 -m bench.bench_multi_gpu --parts layouts,weights,colocate --out "$OUT" \
    2>&1 | tee "$OUT/bench.log" | grep -E "RESULT|FAILED|Error" | cut -c1-300
echo "bench rc=${PIPESTATUS[0]} after $((SECONDS - began)) s"
left=$(( ${TOTAL:-535} - SECONDS ))
timeout -s INT -k 10 "$left" python3 -m pytest tests/gpu -m "not gpu_job" -v -p no:cacheprovider -p no:randomly -rfEs --tb=short \
    -o timeout=240 --durations=0 --junitxml="$OUT/gpu.xml" > "$OUT/gpu.txt" 2>&1
echo "gpu rc=$? after $((SECONDS - began)) s"
grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed" "$OUT/gpu.txt" | cut -c1-200 | tail -30
