#!/usr/bin/env bash
# The suite on a GPU machine (the device's `run`): tests/gpu one test at a time (the GPU to
# themselves) and, beside it, the rest of the suite in parallel. Logs and junit XML go to $OUT.
# Wheels the machine lacks (megatron-core, sglang-router, pylatexenc...) are taken from .whl/.
# GPU_LIMIT, SUITE_LIMIT (seconds) and WORKERS bound the two runs (SHARDS, below, splits the GPU part); PART=gpu or PART=suite runs one;
# GPU_TESTS picks GPU tests (default tests/gpu, without the whole-job ones: scripts/gpu_job_tests.sh
# runs those, minutes each, one machine kind per call).
# The suite's workers share the cores (OMP_NUM_THREADS): torch's default of one thread per core
# in every worker and rank starves the rest (timeouts seen at -n 10 on 16 cores).
cd "$(dirname "$0")/.."
python -m pip install -q --no-deps .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/gpu_suite}
mkdir -p "$OUT"
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.device_count())"
COMMON="-p no:cacheprovider -p no:randomly -p no:benchmark -rfEs --tb=short"
WORKERS=${WORKERS:-8}
if [ "${PART:-gpu}" != suite ]; then
  # SHARDS (a machine of several GPUs): "DEVICES=TESTS;DEVICES=TESTS" runs each group of GPU tests at
  # once on its own GPUs (CUDA_VISIBLE_DEVICES=DEVICES), e.g. "0=tests/gpu/a.py;1=tests/gpu/b.py;2,3=tests/gpu/c.py"
  IFS=';' read -ra shards <<< "${SHARDS:-=${GPU_TESTS:-tests/gpu}}"
  for i in "${!shards[@]}"; do
    devices=${shards[$i]%%=*} tests=${shards[$i]#*=}
    ( [ -n "$devices" ] && export CUDA_VISIBLE_DEVICES=$devices
      timeout -s INT -k 10 "${GPU_LIMIT:-540}" python -m pytest $tests -m "not gpu_job" -v $COMMON --durations=0 \
        --junitxml="$OUT/gpu$i.xml" > "$OUT/gpu$i.txt" 2>&1; echo "gpu rc=$? (GPUs ${devices:-all})" >> "$OUT/gpu$i.txt" ) &
  done
fi
if [ "${PART:-suite}" != gpu ]; then
  OMP_NUM_THREADS=$(( $(nproc) / WORKERS > 0 ? $(nproc) / WORKERS : 1 )) timeout -s INT -k 10 "${SUITE_LIMIT:-545}" \
      python -m pytest tests --ignore=tests/gpu -v $COMMON -n "$WORKERS" --dist load --durations=20 \
      --junitxml="$OUT/suite.xml" > "$OUT/suite.txt" 2>&1
  echo "suite rc=$?" >> "$OUT/suite.txt"
fi
wait
for f in "$OUT"/gpu[0-9]*.txt; do [ -f "$f" ] && { echo "== $f"; grep -E "^(FAILED|ERROR)|passed|failed" "$f" | cut -c1-250 | tail -12; tail -1 "$f"; }; done
[ -f "$OUT/suite.txt" ] && { grep -E "^(FAILED|ERROR)" "$OUT/suite.txt" | cut -c1-250; tail -4 "$OUT/suite.txt"; }
true
