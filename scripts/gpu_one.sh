#!/usr/bin/env bash
# Everything GPU that one 1-GPU device machine can run, in two calls of the device's 10 minutes (the tests that need
# more GPUs skip themselves, saying so). Carry .whl and .debs, e.g.
#   run(kind="nvidia-h200", command="STEP=1 bash scripts/gpu_one.sh", carry=[".whl", ".debs"], timeout_s=590)
#   STEP=1: at once, two chains of tests/gpu sharing the GPU, and the suite on the CPUs (SLURM's tests skip there)
#   STEP=2: at once, the rest of tests/gpu, the GPU job tests of one GPU (scripts/gpu_job_tests.sh PART=one: the
#           engine on the GPU, --colocate for 20 rollouts), and the suite again on fewer workers
#   STEP=4: the compiled one-GPU step profiled (how busy the GPU is), and timed beside 1, 3, 7 and 15 processes that
#           spin a core each (is a DP rank's slower pack its host's?)
#   STEP=3: issue 31's one-GPU benches, one after another: the bare megatron-core step, the trainer's step (TP=1,
#           compiled and not, 8192-token packs) and the colocated publish by reference, profiled (OUT/tensor_profile)
# Logs go to $OUT (gpu*.txt, suite/, job/); the summary of each to stdout. LIMIT bounds each part (seconds).
cd "$(dirname "$0")/.."
export OUT=${OUT:-/tmp/gpu_one} PYTHONPATH=$PWD PYTHONUNBUFFERED=1
mkdir -p "$OUT"
g=tests/gpu
LIMIT=${LIMIT:-520}
case "${STEP:-1}" in
1)
    S0="0=$g/test_gpu_qwen3_next.py $g/test_gpu_ckpt_verify.py $g/test_gpu_fsdp.py $g/test_memory_history.py"
    S0+=" $g/test_trainer_offload.py $g/test_gpu_rl_loop.py"
    S1="0=$g/test_gpu_megatron.py $g/test_megatron_moe.py $g/test_megatron_optimizer_offload.py"
    S1+=" $g/test_gpu_expert_bias_moe.py $g/test_gpu_engine.py $g/test_gpu_tensor_publish.py $g/test_gpu_flattened_publish.py"
    SHARDS="$S0;$S1" GPU_LIMIT=$LIMIT SUITE_LIMIT=$LIMIT WORKERS=${WORKERS:-10} bash scripts/gpu_suite.sh
    ;;
2)
    # the checkpoint families after minimax_m2 (STEP 1's first chain reaches that far), and what follows them
    verify=$g/test_gpu_ckpt_verify.py::test_verify_passes_on_the_gpu
    ( OUT=$OUT/job PART=one LIMIT=$LIMIT bash scripts/gpu_job_tests.sh > "$OUT/job.txt" 2>&1 ) &
    ( OUT=$OUT/suite PART=suite SUITE_LIMIT=$LIMIT WORKERS=${WORKERS:-8} bash scripts/gpu_suite.sh \
        > "$OUT/suite.txt" 2>&1 ) &
    PART=gpu GPU_LIMIT=$LIMIT GPU_TESTS="$verify[qwen3_next] $verify[qwen3_5] $verify[qwen3_5_moe_vl] \
        $g/test_gpu_fsdp.py $g/test_memory_history.py $g/test_trainer_offload.py $g/test_gpu_rl_loop.py \
        $g/test_gpu_tensor_publish.py" bash scripts/gpu_suite.sh
    wait
    echo "== GPU job tests"; tail -12 "$OUT/job.txt"
    echo "== suite"; tail -6 "$OUT/suite.txt"
    ;;
3)
    python -m pip install -q --no-deps .whl/*.whl 2>&1 | tail -2
    timeout -k 10 200 python bench/bench_gpu_megatron.py single --only 5 > "$OUT/bare_megatron.txt" 2>&1
    timeout -k 10 200 python -m bench.bench_trainer_step --shape qwen3-0.6b --samples 16 --min-len 256 --max-len 768 \
        --max-tokens-per-gpu 8192 --repeats 5 > "$OUT/trainer_step.txt" 2>&1
    timeout -k 10 150 python -m bench.bench_tensor_publish --profile "$OUT/tensor_profile" > "$OUT/tensor_publish.txt" 2>&1
    for f in bare_megatron trainer_step tensor_publish; do echo "== $f"; grep -v RESULT "$OUT/$f.txt" | tail -8; done
    ;;
4)
    python -m pip install -q --no-deps .whl/*.whl 2>&1 | tail -2
    timeout -k 10 250 python -m bench.bench_trainer_step --shape qwen3-0.6b --samples 16 --min-len 256 --max-len 768 \
        --max-tokens-per-gpu 8192 --repeats 5 --profile --busy-processes 1,3,7,15 > "$OUT/host_contention.txt" 2>&1
    grep -E "ms/step|profiled step|TFLOP" "$OUT/host_contention.txt"
    ;;
*) echo "STEP must be 1 to 4, got ${STEP}" >&2; exit 2 ;;
esac
