#!/usr/bin/env bash
# Everything GPU that one 4-GPU device machine can run in two calls of the device's 10 minutes, with the
# GPUs split between runs that do not share one (see each STEP). Carry .whl and .debs, e.g.
#   run(kind="nvidia-h100-x4", command="STEP=1 bash scripts/gpu_four.sh", carry=[".whl", ".debs"])
#   STEP=1: the log-probs chunk bench on a quiet GPU; then, at once: the suite on the CPUs (24 workers),
#           tests/gpu in three shards (GPU 0, GPU 1, GPUs 2-3) and the GPU demo job (scripts/gpu_job.sh)
#   STEP=2: the NCCL publish bench on GPUs 0-1 (nothing else running), then every GPU job test
#           (scripts/gpu_job_tests.sh, PART=all) until LIMIT
#   STEP=4: the publish by reference into an engine on the trainer's GPU (bench/bench_tensor_publish.py,
#           issue 31) and tests/gpu/test_gpu_tensor_publish.py; the async bench (issue 32): the trainer on
#           GPU 0 against CPU engines with simulated decode, then against engines decoding on GPU 1
#   STEP=5: a rerun after fixes, at once: on GPUs 0-1 the publish benches (by reference; NCCL with where
#           its time goes), then DP=2's step profiled against TP=1 (compiled, 8192-token packs); on GPUs
#           2-3 the GLM-4 trainer tests (GPU_TRAINER_TESTS too) a GPU per rank, then tests/gpu's expert-bias
#           MoE with MTP on GPU 2 beside the GPU RL loop, the tensor publish (GPU_TESTS too) and the async
#           bench (CPU engines, HOLD_MS per decode step) on GPU 3; SUITE_TESTS (default the tests that
#           failed there last) on the CPUs
#   STEP=6: DP=4 (LAYOUTS) against TP=1 (compiled, 8192-token packs, SAMPLES default 128), each profiled one
#           more step (PROFILE=0: not), on quiet GPUs, until LIMIT (TP=1 alone took 82 s profiled; 190 s cut
#           DP=4 off). The GPU job tests need a call of their own (PART=four bash scripts/gpu_job_tests.sh)
#   STEP=7: DP=4's step by phase on every rank (SAMPLES, default 128; LAYOUTS, default dp4_distopt; PROFILE_LAYOUTS,
#           default tp1 and LAYOUTS), then LAYOUTS and TP=1 unprofiled on a batch four times larger (a fixed cost per
#           step shows as a ratio that grows with it)
#   STEP=8: the machine's links (nvidia-smi topo, NVLink state), scripts/nccl_probe.py over all four GPUs with NCCL's
#           log (its transport and algorithm), then over GPU pairs (0,1), (2,3), (0,2): whether four GPUs reduce
#           slower than two because of the links or because of the ring's length
#   STEP=9: DP=4 by phase on every rank (round-robin packs and --balance-data, SAMPLES default 128) with the GPUs'
#           clocks and power sampled each second (nvidia-smi dmon), then both on a batch four times larger unprofiled
#   STEP=3: the log-probs chunk bench, then the suite alone (a rerun after fixes; the device brings back
#           8 files at most, so this step writes three)
# Logs go to $OUT (one file per run, 8 at most); the summary of each to stdout.
cd "$(dirname "$0")/.."
export OUT=${OUT:-/tmp/gpu_four} PYTHONPATH=$PWD PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # the device's KINDS.md
mkdir -p "$OUT"
COMMON="-p no:cacheprovider -p no:randomly -p no:benchmark -rfEs --tb=short"
python -m pip install -q --no-deps .whl/*.whl 2>&1 | tail -2
nvidia-smi -L
case "${STEP:-1}" in
1)
    CUDA_VISIBLE_DEVICES=3 timeout 90 python -m bench.bench_log_probs_chunk 2>&1 | tee "$OUT/bench_log_probs_chunk.txt" | tail -6
    ( timeout -k 10 460 bash scripts/gpu_job.sh > "$OUT/gpu_job.txt" 2>&1; echo "gpu_job.sh rc=$?" >> "$OUT/gpu_job.txt"
      python -m jobs.cli cluster down --dir /tmp/slurmrl-devcluster >> "$OUT/gpu_job.txt" 2>&1 ) &
    g=tests/gpu
    SHARDS="0=$g/test_gpu_ckpt_verify.py $g/test_gpu_fsdp.py $g/test_memory_history.py $g/test_trainer_offload.py $g/test_gpu_rl_loop.py"
    SHARDS+=";1=$g/test_gpu_megatron.py $g/test_megatron_moe.py $g/test_megatron_optimizer_offload.py $g/test_gpu_expert_bias_moe.py"
    SHARDS+=";2,3=$g/test_multi_gpu.py $g/test_gpu_flattened_publish.py"
    SHARDS=$SHARDS GPU_LIMIT=480 SUITE_LIMIT=480 WORKERS=24 bash scripts/gpu_suite.sh
    wait
    grep -E "reward:|rc=|did not|completed" "$OUT/gpu_job.txt" | tail -8
    ;;
2)
    timeout -k 10 150 python -m bench.bench_multi_gpu --parts weights --out "$OUT" > "$OUT/bench_weights.txt" 2>&1
    echo "bench rc=$?"; grep RESULT "$OUT/bench_weights.txt" | cut -c1-400
    PART=all LIMIT=${LIMIT:-400} bash scripts/gpu_job_tests.sh
    ;;
3)
    CUDA_VISIBLE_DEVICES=3 timeout 120 python -m bench.bench_log_probs_chunk 2>&1 | tee "$OUT/bench_log_probs_chunk.txt" | tail -6
    PART=suite SUITE_LIMIT=${LIMIT:-450} WORKERS=24 bash scripts/gpu_suite.sh
    ;;
4)
    timeout -k 10 150 python -m bench.bench_tensor_publish 2>&1 | tee "$OUT/bench_tensor_publish.txt" | tail -2
    timeout -k 10 120 python -m pytest -q -p no:randomly tests/gpu/test_gpu_tensor_publish.py 2>&1 | tail -15
    timeout -k 10 280 python -m bench.bench_async 2>&1 | tee "$OUT/bench_async_cpu_engines.txt" | grep -E "x[0-9.]+ of sync"
    timeout -k 10 280 python -m bench.bench_async --engine-device cuda --hold-ms 0 2>&1 \
        | tee "$OUT/bench_async_gpu_engines.txt" | grep -E "x[0-9.]+ of sync"
    ;;
5)
    ( export CUDA_VISIBLE_DEVICES=0,1
      timeout -k 10 100 python -m bench.bench_tensor_publish > "$OUT/bench_tensor_publish.txt" 2>&1
      timeout -k 10 150 python -m bench.bench_multi_gpu --parts weights --out /tmp/bench_weights \
          > "$OUT/bench_weights.txt" 2>&1
      timeout -k 10 240 python -m bench.bench_multi_gpu --parts layouts --layouts dp2_distopt --torch-compile \
          --max-tokens-per-gpu 8192 --profile --out /tmp/bench_layouts > "$OUT/bench_dp2_profile.txt" 2>&1 ) &
    ( export CUDA_VISIBLE_DEVICES=2,3
      timeout -k 10 200 python -m pytest -v $COMMON tests/trainer/test_megatron_glm4.py ${GPU_TRAINER_TESTS:-} \
          > "$OUT/trainer_tests_on_gpus.txt" 2>&1
      CUDA_VISIBLE_DEVICES=2 timeout -k 10 300 python -m pytest -v $COMMON tests/gpu/test_gpu_expert_bias_moe.py \
          > "$OUT/gpu_expert_bias_mtp.txt" 2>&1 &
      export CUDA_VISIBLE_DEVICES=3
      timeout -k 10 150 python -m pytest -v $COMMON tests/gpu/test_gpu_rl_loop.py tests/gpu/test_gpu_tensor_publish.py \
          ${GPU_TESTS:-} > "$OUT/gpu_loop.txt" 2>&1
      # the async bench with generation about half of a synchronous rollout, as in published RL runs
      timeout -k 10 170 python -m bench.bench_async --hold-ms "${HOLD_MS:-8}" --rollouts 10 \
          > "$OUT/bench_async_balanced.txt" 2>&1
      wait ) &
    CUDA_VISIBLE_DEVICES="" OMP_NUM_THREADS=2 timeout -k 10 480 python -m pytest -q $COMMON -n 8 \
        ${SUITE_TESTS:-tests/trainer/test_publish.py tests/trainer/test_config_boundary.py tests/jobs/test_slime_flags.py \
        tests/trainer/test_slime_flag_values.py} > "$OUT/suite_part.txt" 2>&1 &
    wait
    grep -h "^qwen3\|^tiny" "$OUT/bench_tensor_publish.txt"; grep -h RESULT "$OUT"/bench_weights.txt | cut -c1-900
    grep -h RESULT "$OUT/bench_dp2_profile.txt" | cut -c1-600; grep -hE "x[0-9.]+ of sync" "$OUT/bench_async_balanced.txt"
    for f in trainer_tests_on_gpus gpu_expert_bias_mtp gpu_loop suite_part; do
        echo "== $f"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/$f.txt" | cut -c1-250 | tail -8; done
    ;;
6)
    STEP=4 WEIGHTS=0 LAYOUTS=${LAYOUTS:-dp4_overlap} SAMPLES=${SAMPLES:-128} LIMIT=${LIMIT:-400} \
        PROFILE=$([ "${PROFILE:-1}" = 1 ] && echo 1) bash scripts/gpu_two.sh
    ;;
7)
    samples=${SAMPLES:-128}
    layouts=${LAYOUTS:-dp4_distopt}
    for run in "profiled $samples ${PROFILE_LAYOUTS:-tp1,$layouts} --profile" "unprofiled $((samples * 4)) $layouts"; do
        set -- $run
        timeout -k 10 "${LIMIT:-280}" python -m bench.bench_multi_gpu --parts layouts --torch-compile \
            --max-tokens-per-gpu 8192 --samples "$2" --layouts "$3" $4 --out "/tmp/layouts_$1" > "$OUT/dp4_$1.txt" 2>&1
        echo "== $1, $2 samples: rc=$?"; grep -h RESULT "$OUT/dp4_$1.txt" | cut -c1-600
        grep -h -A40 "^PROFILE" "$OUT/dp4_$1.txt" | grep -E "^(PROFILE|rank|phase|packs|grad_|optim|zero|metrics|profiled)"
    done
    ;;
8)
    { nvidia-smi topo -m; nvidia-smi nvlink --status | head -40; nvidia-smi -q | grep -i -E "fabric|clique|bus id"; } \
        > "$OUT/links.txt" 2>&1
    head -12 "$OUT/links.txt"
    timeout -k 10 150 python scripts/nccl_probe.py --debug --variants default,simple,tree,channels32 > "$OUT/probe4.txt" 2>&1
    echo "== four GPUs: rc=$?"; grep -v "NCCL INFO" "$OUT/probe4.txt" | tail -16
    grep -E "NCCL INFO .*(via |Channel 00|Ring 00|Trees|NVLS|P2P|SHM|comm 0x.* nRanks)" "$OUT/probe4.txt" | head -24
    for pair in 0,1 2,3 0,2; do
        CUDA_VISIBLE_DEVICES=$pair timeout -k 10 60 python scripts/nccl_probe.py --variants default \
            > "$OUT/probe_$pair.txt" 2>&1
        echo "== GPUs $pair: rc=$?"; grep -v "NCCL INFO" "$OUT/probe_$pair.txt" | tail -6
    done
    ;;
9)
    nvidia-smi dmon -s pc -d 1 > "$OUT/dmon.txt" 2>&1 &
    dmon=$!
    STEP=7 LAYOUTS=dp4_distopt,dp4_balanced PROFILE_LAYOUTS=dp4_distopt,dp4_balanced LIMIT=${LIMIT:-250} \
        bash scripts/gpu_four.sh
    kill "$dmon"
    awk 'NR <= 2 || NR % 10 == 0' "$OUT/dmon.txt" | head -60
    ;;
*) echo "STEP must be 1 to 7, got $STEP" >&2; exit 2 ;;
esac
rm -f "$OUT"/*.xml  # the device brings back 8 files at most: the .txt logs say what the XML would
true
