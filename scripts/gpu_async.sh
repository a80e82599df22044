#!/usr/bin/env bash
# Issue 32's goal on a 4-GPU device machine: the async bench (bench/bench_async.py) on a job whose
# training is about a third of a synchronous rollout, as in published RL runs, three ways at once,
# each on GPUs and cores of its own (taskset: the CPU engines must not share cores across runs):
#   GPU 0, cores 0-15:  the simulation (CPU engines, each decode step held HOLD_MS), STEPS optimizer
#                       steps a rollout
#   GPU 1, cores 16-31: the simulation with a larger batch (BATCH prompts) and one step a rollout
#   GPUs 2-3, cores 32-47: real decode, the engines on a GPU of their own, STEPS steps a rollout
# Carry .whl:  run(kind="nvidia-h100-x4", command="bash scripts/gpu_async.sh", carry=[".whl"])
cd "$(dirname "$0")/.."
export OUT=${OUT:-/tmp/gpu_async} PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
mkdir -p "$OUT"
python -m pip install -q --no-deps .whl/*.whl 2>&1 | tail -2
nvidia-smi -L
HOLD_MS=${HOLD_MS:-8} STEPS=${STEPS:-4} BATCH=${BATCH:-48} ROLLOUTS=${ROLLOUTS:-8} LIMIT=${LIMIT:-500}
bench() {  # name, GPUs, cores, bench flags...
    local name=$1 gpus=$2 cores=$3; shift 3
    CUDA_VISIBLE_DEVICES=$gpus timeout -k 10 "$LIMIT" taskset -c "$cores" \
        python -m bench.bench_async --rollouts "$ROLLOUTS" --modes sync,fully_async,train_async "$@" > "$OUT/bench_async_$name.txt" 2>&1
    echo "$name rc=$?" >> "$OUT/bench_async_$name.txt"
}
bench sim_steps$STEPS 0 0-15 --hold-ms "$HOLD_MS" --steps-per-rollout "$STEPS" &
bench sim_batch$BATCH 1 16-31 --hold-ms "$HOLD_MS" --batch "$BATCH" &
bench gpu_engines_steps$STEPS 2,3 32-47 --engine-device cuda --hold-ms 0 --steps-per-rollout "$STEPS" &
wait
for f in "$OUT"/bench_async_*.txt; do echo "== $f"; grep -E "of sync|rc=|Error" "$f" | cut -c1-300; done
