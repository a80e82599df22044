#!/usr/bin/env bash
# Everything GPU that one 2-GPU device machine can run in two calls of the device's 10 minutes. Carry .whl and
# .debs (scripts/fetch_device_wheels.sh brings flash-linear-attention for Qwen3-Next's kernel), e.g.
#   run(kind="nvidia-h100-x2", command="STEP=1 bash scripts/gpu_two.sh", carry=[".whl", ".debs"])
#   STEP=1: at once, the suite on the CPUs and tests/gpu's one-GPU tests in two shards (GPU 0, GPU 1)
#   STEP=2: at once, the GPU demo job (scripts/gpu_job.sh: a devcluster over both GPUs) and Qwen3-Next's trainer
#           tests a GPU per rank; then tests/gpu's two-GPU tests
#   STEP=3: a rerun after fixes of STEP 1 and 2's GPU parts, all at once (but the two-GPU tests), and SUITE_TESTS
#   STEP=4: issue 31's benches (the layouts, compiled, 8192-token packs; the NCCL publish), run by the tree at BASE
#           (an earlier commit's files, e.g. `git archive SHA | tar -x -C base`: the baseline) and then by this one;
#           PROFILE=1: each layout's ops of one more step; WEIGHTS=0: the layouts only; SAMPLES: the batch
#   STEP=5: the one-GPU step (TP=1, compiled) of the tree at BASE and of this one at once, each on a GPU of its own,
#           then again with the GPUs swapped; then STEP 4's layouts on SAMPLES (default 128) samples
#   STEP=6: after a trainer change, all at once: a chain of tests/gpu on each GPU, the demo job over both, and the
#           megatron layout tests a GPU per rank (the gradient buckets, Qwen3-Next and Qwen3.5)
#   STEP=7: after a checkpoint-layout change, all at once: ckpt verify of every family on GPU 0, the MoE tests on GPU 1,
#           Qwen3-Next's and Qwen3.5's layouts a GPU per rank (PP=2 with the alltoall dispatcher among them); then
#           the NCCL publish bench with its breakdown (engine calls, receive, load)
#   STEP=8: after a publish change: the NCCL publish bench to one engine then to two (ENGINES: "1 2"; two need a GPU
#           each beside the trainer's) and the colocated publish by reference, by the tree at BASE and then by this
#           one; then the GPU tests of the publish paths. PROFILE=1: this tree's publishes also profiled (the
#           trainer's side under cProfile, and the parts of a publish by reference: OUT/profile_*.txt)
#   STEP=9: TP=2 + SP against DP=2 (distributed optimizer) on the Qwen3-8B shape (bench/bench_tp_8b.py; TOKENS a
#           pack, default 8192; H200s: DP=2 of 8B does not fit 80 GB), then the GPU tests of the publish paths
#   STEP=10: scripts/nccl_probe.py (the gradient reduce's collectives under NCCL's choice and forced protocols),
#           then DP=2's step profiled by phase with NCCL's choice and with NCCL_PROTO=Simple
#   STEP=11: after a change to the gradient reduce: tests/gpu/test_multi_gpu.py, the NCCL probe (NCCL's own choice),
#           then STEP 4's layouts (LAYOUTS, SAMPLES, LIMIT, BASE) without the NCCL publish; PROBE=0: without the
#           probe (after a pipeline change)
#   STEP=12: TESTS (pytest node ids) bounded by TEST_LIMIT; at the bound every process of the run dumps its Python
#           stacks (SIGABRT under PYTHONFAULTHANDLER: a hung rank shows where it waits); then STEP 4's layouts
#           (LAYOUTS, SAMPLES, PROFILE) without the NCCL publish
# Logs go to $OUT (one file per run, 8 at most); the summary of each to stdout.
cd "$(dirname "$0")/.."
export OUT=${OUT:-/tmp/gpu_two} PYTHONPATH=$PWD PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # the device's KINDS.md
mkdir -p "$OUT"
COMMON="-p no:cacheprovider -p no:randomly -p no:benchmark -rfEs --tb=short"
python -m pip install -q --no-deps .whl/*.whl 2>&1 | tail -2
nvidia-smi -L
g=tests/gpu
case "${STEP:-1}" in
1)
    SHARDS="0=$g/test_gpu_qwen3_next.py $g/test_gpu_ckpt_verify.py $g/test_gpu_fsdp.py $g/test_memory_history.py"
    SHARDS+=" $g/test_trainer_offload.py $g/test_gpu_rl_loop.py"
    SHARDS+=";1=$g/test_gpu_megatron.py $g/test_megatron_moe.py $g/test_megatron_optimizer_offload.py"
    SHARDS+=" $g/test_gpu_expert_bias_moe.py $g/test_gpu_engine.py $g/test_gpu_tensor_publish.py"
    SHARDS=$SHARDS GPU_LIMIT=${LIMIT:-520} SUITE_LIMIT=${LIMIT:-520} WORKERS=${WORKERS:-20} bash scripts/gpu_suite.sh
    ;;
2)
    ( timeout -k 10 330 bash scripts/gpu_job.sh > "$OUT/gpu_job.txt" 2>&1; echo "gpu_job.sh rc=$?" >> "$OUT/gpu_job.txt"
      python -m jobs.cli cluster down --dir /tmp/slurmrl-devcluster >> "$OUT/gpu_job.txt" 2>&1 ) &
    timeout -k 10 330 python -m pytest -v $COMMON tests/trainer/test_megatron_qwen3_next.py \
        > "$OUT/trainer_qwen3_next_on_gpus.txt" 2>&1
    wait
    timeout -k 10 "${LIMIT:-200}" python -m pytest -v $COMMON -m "not gpu_job" $g/test_multi_gpu.py \
        $g/test_gpu_flattened_publish.py > "$OUT/gpu_two_gpu_tests.txt" 2>&1
    grep -E "reward:|rc=|did not|completed" "$OUT/gpu_job.txt" | tail -8
    for f in trainer_qwen3_next_on_gpus gpu_two_gpu_tests; do
        echo "== $f"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/$f.txt" | cut -c1-250 | tail -8; done
    ;;
3)
    # at once: GPU 0 and GPU 1 each a chain of tests/gpu, the demo job over both, Qwen3-Next's trainer tests a GPU per
    # rank, and SUITE_TESTS (default: those that failed here last) on the CPUs
    ( export CUDA_VISIBLE_DEVICES=0
      timeout -k 10 ${LIMIT:-500} python -m pytest -v $COMMON -m "not gpu_job" $g/test_gpu_qwen3_next.py \
          $g/test_gpu_ckpt_verify.py $g/test_gpu_rl_loop.py $g/test_gpu_fsdp.py $g/test_memory_history.py \
          $g/test_trainer_offload.py > "$OUT/gpu0.txt" 2>&1 ) &
    ( export CUDA_VISIBLE_DEVICES=1
      timeout -k 10 ${LIMIT:-500} python -m pytest -v $COMMON -m "not gpu_job" $g/test_gpu_expert_bias_moe.py \
          $g/test_gpu_engine.py $g/test_gpu_tensor_publish.py $g/test_megatron_optimizer_offload.py \
          > "$OUT/gpu1.txt" 2>&1 ) &
    ( timeout -k 10 330 bash scripts/gpu_job.sh > "$OUT/gpu_job.txt" 2>&1; echo "gpu_job.sh rc=$?" >> "$OUT/gpu_job.txt"
      python -m jobs.cli cluster down --dir /tmp/slurmrl-devcluster >> "$OUT/gpu_job.txt" 2>&1 ) &
    timeout -k 10 400 python -m pytest -v $COMMON tests/trainer/test_megatron_qwen3_next.py \
        > "$OUT/trainer_qwen3_next_on_gpus.txt" 2>&1 &
    CUDA_VISIBLE_DEVICES="" OMP_NUM_THREADS=2 timeout -k 10 ${LIMIT:-500} python -m pytest -q $COMMON -n 6 \
        ${SUITE_TESTS:-tests/ckpt_tools/test_gated_delta_net.py tests/ckpt_tools/test_megatron_parity.py \
        tests/trainer/test_megatron_glm4.py tests/trainer/test_slime_flag_values.py \
        tests/trainer/test_megatron_minimax_m2.py} > "$OUT/suite_part.txt" 2>&1 &
    wait
    grep -E "reward:|rc=|did not|completed" "$OUT/gpu_job.txt" | tail -8
    for f in gpu0 gpu1 trainer_qwen3_next_on_gpus suite_part; do
        echo "== $f"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/$f.txt" | cut -c1-250 | tail -8; done
    ;;
4)
    for tree in ${BASE:-} .; do
        name=$([ "$tree" = . ] && echo new || echo base)
        ( cd "$tree" && export PYTHONPATH=$PWD
          timeout -k 10 "${LIMIT:-200}" python -m bench.bench_multi_gpu --parts layouts --torch-compile \
              --layouts "${LAYOUTS:-dp2_distopt,dp2_overlap}" --max-tokens-per-gpu 8192 --out "/tmp/layouts_$name" \
              ${PROFILE:+--profile} ${SAMPLES:+--samples $SAMPLES}
          [ "${WEIGHTS:-1}" = 0 ] || timeout -k 10 120 python -m bench.bench_multi_gpu --parts weights \
              --out "/tmp/weights_$name" ) > "$OUT/bench31_$name.txt" 2>&1
        echo "== $name"; grep -h RESULT "$OUT/bench31_$name.txt" | cut -c1-500
    done
    ;;
5)
    for order in 0,1 1,0; do
        for tree in "$BASE" .; do
            name=$([ "$tree" = . ] && echo new || echo base)
            [ "$tree" = . ] && gpus=$order || gpus=$(echo "$order" | rev)  # the other GPU first
            ( cd "$tree" && PYTHONPATH=$PWD CUDA_VISIBLE_DEVICES=$gpus timeout -k 10 150 python -m bench.bench_multi_gpu \
                --parts layouts --torch-compile --layouts none --max-tokens-per-gpu 8192 --out "/tmp/tp1_$name" \
                > "$OUT/tp1_${name}_gpu${gpus%%,*}.txt" 2>&1 ) &
        done
        wait
    done
    grep -H RESULT "$OUT"/tp1_*.txt | cut -c1-330
    STEP=4 BASE= WEIGHTS=0 SAMPLES=${SAMPLES:-128} LIMIT=${LIMIT:-300} bash "$0"
    ;;
6)
    ( export CUDA_VISIBLE_DEVICES=0
      timeout -k 10 "${LIMIT:-420}" python -m pytest -v $COMMON -m "not gpu_job" $g/test_gpu_qwen3_next.py \
          $g/test_gpu_rl_loop.py $g/test_gpu_ckpt_verify.py > "$OUT/gpu0.txt" 2>&1 ) &
    ( export CUDA_VISIBLE_DEVICES=1
      timeout -k 10 "${LIMIT:-420}" python -m pytest -v $COMMON -m "not gpu_job" $g/test_gpu_megatron.py \
          $g/test_gpu_expert_bias_moe.py $g/test_megatron_moe.py > "$OUT/gpu1.txt" 2>&1 ) &
    ( timeout -k 10 330 bash scripts/gpu_job.sh > "$OUT/gpu_job.txt" 2>&1; echo "gpu_job.sh rc=$?" >> "$OUT/gpu_job.txt"
      python -m jobs.cli cluster down --dir /tmp/slurmrl-devcluster >> "$OUT/gpu_job.txt" 2>&1 ) &
    timeout -k 10 "${LIMIT:-420}" python -m pytest -v $COMMON tests/trainer/test_grad_buckets.py \
        tests/trainer/test_megatron_backend.py tests/trainer/test_megatron_qwen3_next.py \
        > "$OUT/trainer_layouts_on_gpus.txt" 2>&1 &
    wait
    grep -E "reward:|rc=|did not|completed" "$OUT/gpu_job.txt" | tail -8
    for f in gpu0 gpu1 trainer_layouts_on_gpus; do
        echo "== $f"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/$f.txt" | cut -c1-250 | tail -8; done
    ;;
7)
    ( export CUDA_VISIBLE_DEVICES=0
      timeout -k 10 "${LIMIT:-420}" python -m pytest -v $COMMON $g/test_gpu_ckpt_verify.py > "$OUT/gpu0.txt" 2>&1 ) &
    ( export CUDA_VISIBLE_DEVICES=1
      timeout -k 10 "${LIMIT:-420}" python -m pytest -v $COMMON $g/test_megatron_moe.py $g/test_gpu_expert_bias_moe.py \
          > "$OUT/gpu1.txt" 2>&1 ) &
    timeout -k 10 "${LIMIT:-420}" python -m pytest -v $COMMON tests/trainer/test_megatron_qwen3_next.py \
        > "$OUT/trainer_qwen3_next_on_gpus.txt" 2>&1 &
    wait
    for f in gpu0 gpu1 trainer_qwen3_next_on_gpus; do
        echo "== $f"; grep -E "^(FAILED|ERROR)|passed|failed|SKIPPED" "$OUT/$f.txt" | cut -c1-250 | tail -8; done
    timeout -k 10 150 python -m bench.bench_multi_gpu --parts weights --out /tmp/weights > "$OUT/bench_weights.txt" 2>&1
    grep -h RESULT "$OUT/bench_weights.txt" | cut -c1-900
    ;;
8)
    for tree in ${BASE:-} .; do
        name=$([ "$tree" = . ] && echo new || echo base)
        ( cd "$tree" && export PYTHONPATH=$PWD
          profile=$([ "$name" = new ] && [ "${PROFILE:-0}" = 1 ] && echo 1)
          for n in ${ENGINES:-1 2}; do
              timeout -k 10 100 python -m bench.bench_multi_gpu --parts weights --weight-engines $n --out /tmp/w_$name$n \
                  ${profile:+--profile}
              [ -z "$profile" ] || cp /tmp/w_$name$n/profile_publish_* "$OUT/"
          done
          CUDA_VISIBLE_DEVICES=0 timeout -k 10 150 python -m bench.bench_tensor_publish ${profile:+--profile "$OUT"}
        ) > "$OUT/publish_$name.txt" 2>&1
        echo "== $name"; grep -h RESULT "$OUT/publish_$name.txt" | cut -c1-1000
    done
    timeout -k 10 "${LIMIT:-200}" python -m pytest -v $COMMON $g/test_gpu_flattened_publish.py $g/test_gpu_engine.py \
        $g/test_gpu_tensor_publish.py -m "not gpu_job" > "$OUT/publish_tests.txt" 2>&1
    grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/publish_tests.txt" | cut -c1-250 | tail -8
    ;;
9)
    timeout -k 10 "${LIMIT:-420}" python -m bench.bench_tp_8b --max-tokens-per-gpu "${TOKENS:-8192}" \
        > "$OUT/bench_tp_8b.txt" 2>&1
    grep -h RESULT "$OUT/bench_tp_8b.txt" | cut -c1-900
    nvidia-smi --query-gpu=memory.total --format=csv,noheader | head -1
    timeout -k 10 150 python -m pytest -v $COMMON $g/test_gpu_flattened_publish.py $g/test_gpu_engine.py \
        $g/test_gpu_tensor_publish.py -m "not gpu_job" > "$OUT/publish_tests.txt" 2>&1
    grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/publish_tests.txt" | cut -c1-250 | tail -8
    ;;
10)
    timeout -k 10 120 python scripts/nccl_probe.py --debug > "$OUT/nccl_probe.txt" 2>&1
    grep -v "NCCL INFO" "$OUT/nccl_probe.txt" | tail -20
    grep -E "NCCL INFO (Algorithm|  *(Max|Tree|Ring|Protocol|Latency|Bandwidth)|.*(P2P|NVLS|nvls|Channel 00))" \
        "$OUT/nccl_probe.txt" | head -30
    for proto in "" Simple; do  # DP=2's step with NCCL's own protocol, then with the one the probe found faster
        env ${proto:+NCCL_PROTO=$proto} timeout -k 10 "${LIMIT:-170}" python -m bench.bench_multi_gpu --parts layouts \
            --torch-compile --max-tokens-per-gpu 8192 --samples "${SAMPLES:-128}" --layouts dp2_distopt --profile \
            --out "/tmp/layouts_$proto" > "$OUT/dp2_proto_${proto:-default}.txt" 2>&1
        echo "== NCCL_PROTO=${proto:-unset}"; grep -h RESULT "$OUT/dp2_proto_${proto:-default}.txt" | cut -c1-400
        grep -h -A9 "^PROFILE" "$OUT/dp2_proto_${proto:-default}.txt" | grep -v "^--$" | head -24
    done
    ;;
11)
    timeout -k 10 "${TEST_LIMIT:-300}" python -m pytest -v $COMMON $g/test_multi_gpu.py > "$OUT/test_multi_gpu.txt" 2>&1
    grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/test_multi_gpu.txt" | cut -c1-250 | tail -8
    if [ "${PROBE:-1}" = 1 ]; then
        timeout -k 10 60 python scripts/nccl_probe.py --variants default > "$OUT/nccl_probe.txt" 2>&1
        cat "$OUT/nccl_probe.txt"
    fi
    STEP=4 WEIGHTS=0 bash scripts/gpu_two.sh
    ;;
12)
    PYTHONFAULTHANDLER=1 python -m pytest -v $COMMON --durations=0 $TESTS > "$OUT/tests.txt" 2>&1 &
    run=$!
    deadline=$((SECONDS + ${TEST_LIMIT:-200}))
    while kill -0 $run 2>/dev/null && [ $SECONDS -lt $deadline ]; do sleep 1; done
    if kill -0 $run 2>/dev/null; then  # the bound: every process under the run, children first, dumps its stacks
        tree() { for child in $(pgrep -P "$1"); do tree "$child"; done; echo "$1"; }
        echo "TEST_LIMIT reached: stacks of $(tree $run | tr '\n' ' ')" >> "$OUT/tests.txt"
        for pid in $(tree $run); do kill -ABRT "$pid" 2>/dev/null; sleep 0.5; done  # one dump at a time
    fi
    wait $run
    grep -E "^(FAILED|ERROR)|passed|failed|TEST_LIMIT|^[0-9.]+s (call|setup)" "$OUT/tests.txt" | cut -c1-250 | tail -20
    STEP=4 WEIGHTS=0 bash scripts/gpu_two.sh
    ;;
*) echo "STEP must be 1 to 12, got $STEP" >&2; exit 2 ;;
esac
rm -f "$OUT"/*.xml  # the device brings back 8 files at most: the .txt logs say what the XML would
true
