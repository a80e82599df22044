#!/usr/bin/env bash
# Issue 29 item 1's device run (2 GPUs): tests/gpu/test_multi_gpu.py (every layout, compiled or not,
# against TP=1 in fp32), then bench/multigpu_grads.py's per-parameter gradients of one RL step on
# the Qwen3-0.6B shape in bf16, compiled and not, against TP=1's; logs under $OUT.
#   run(kind="nvidia-h100-x2", command="bash scripts/grad_probe_run.sh", carry=[".whl"])
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/grads}
mkdir -p "$OUT"
nvidia-smi -L
timeout -s INT -k 10 "${TEST_LIMIT:-240}" python3 -m pytest tests/gpu/test_multi_gpu.py -v -p no:cacheprovider -p no:randomly \
    -rfEs --tb=short --durations=0 > "$OUT/multi_gpu.txt" 2>&1
echo "tests rc=$?"; grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/multi_gpu.txt" | cut -c1-200 | tail -12
timeout -s INT -k 10 "${BENCH_LIMIT:-240}" python3 -m bench.multigpu_grads --shape qwen3-0.6b --dtype bf16 \
    --variants "${VARIANTS:-tp1,tp2_sp,tp2_sp+compile}" > "$OUT/grads.log" 2>&1
echo "bench rc=$?"; grep -E "^RESULT" "$OUT/grads.log" | cut -c1-700
