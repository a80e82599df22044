#!/usr/bin/env bash
# The GPU twin of scripts/main_job.sh, what to run first on a GPU box: bring the SLURM devcluster up
# over this machine's GPUs (one emulated node per GPU, the GPU its gres; SLURM and munge from the
# carried .deb files where the machine has no SLURM, `bash scripts/fetch_slurm_debs.sh` where apt
# works; no accounting), then run the demo job (examples/demo_job.yaml) with the trainer on a GPU
# (megatron backend, --bf16) and stand-in engines on the other GPUs (--rollout-engine standin),
# weights over NCCL between the steps. On one GPU the trainer and the engine share it (--colocate,
# with offload) and the weights go through disk: NCCL refuses two ranks on one GPU. Prints
# `slurmrl status` while it runs, the reward and the GPU figures of every rollout, and the report's
# plots. Wheels the machine lacks (megatron-core, sglang-router, ...) come from .whl/ if present.
# On the device: run(command="bash scripts/gpu_job.sh", carry=[".whl", ".debs"]).
# Exits non-zero unless the job completes with its reward rising. The devcluster stays up
# (`python -m jobs.cli cluster down`).
set -euo pipefail
cd "$(dirname "$0")/.."
if compgen -G ".whl/*.whl" > /dev/null; then python -m pip install -q --no-deps .whl/*.whl 2>&1 | tail -2; fi
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
# NVLink multicast stays off (the device's KINDS.md says why).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
slurmrl() { python -m jobs.cli "$@"; }
gpus=$(python -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)")
[ "$gpus" -ge 1 ] || { echo "torch sees no CUDA GPU here: scripts/main_job.sh runs the demo on CPU engines" >&2; exit 1; }
nvidia-smi -L || true

root=${SLURMRL_DEVCLUSTER_DIR:-/tmp/slurmrl-devcluster}
up=(--dir "$root" --gpus real --nodes "$gpus" --gpus-per-node 1 --no-accounting "${SLURMRL_NETWORK:---shared-loopback}")
command -v slurmctld > /dev/null || up+=(--debs "${SLURMRL_DEBS:-.debs}")
slurmrl cluster up "${up[@]}"
# shellcheck disable=SC1091
source "$root/env.sh"  # SLURM_CONF, and PATH/LD_LIBRARY_PATH of an unpacked SLURM

on_gpus=(--train-backend megatron --bf16 --rollout-engine standin --actor-num-gpus-per-node 1
         --rollout-num-gpus-per-node 1)
if [ "$gpus" -eq 1 ]; then
    layout=(--colocate --rollout-num-gpus 1 --rollout-num-engines 1 --sglang-mem-fraction-static 0.3
            --update-weight-transport disk)
    echo "1 GPU: the trainer and one engine share it (--colocate); weights through disk"
else
    engines=$((gpus - 1))
    layout=(--rollout-num-gpus "$engines" --rollout-num-engines "$engines" --update-weight-transport nccl)
    echo "$gpus GPUs: the trainer on one, $engines engine(s) on the others; weights over NCCL"
fi

work=${SLURMRL_DEMO_DIR:-/tmp/slurmrl-gpu-demo}
mkdir -p "$work"
[ -f "$work/model/config.json" ] || slurmrl tiny-model "$work/model"
[ -f "$work/demo.jsonl" ] || slurmrl toy-data "$work/demo.jsonl" --labels 0123456789
job_dir="$work/job-$(date +%Y%m%d-%H%M%S)"
job_id=$(slurmrl submit examples/demo_job.yaml --json --job-dir "$job_dir" --hf-checkpoint "$work/model" \
    --prompt-data "$work/demo.jsonl" "${on_gpus[@]}" "${layout[@]}" \
    | python -c 'import json,sys; print(json.loads(sys.stdin.read().strip().splitlines()[-1])["job_id"])')
echo "submitted job $job_id; job directory $job_dir"
while squeue -h -j "$job_id" -o %i | grep -q .; do
    [ -f "$job_dir/supervisor_state.json" ] && { echo; slurmrl status "$job_dir" || true; }
    sleep 10
done
echo
slurmrl status "$job_dir"
rising=yes
python - "$job_dir/metrics.jsonl" <<'PY' || rising=no
import json, sys
from contract.job_dir import PHASE_PEAK_GPU_MEMORY, PHASE_TIMES, Metric
rows = [json.loads(line) for line in open(sys.argv[1])]
print("\nrollout  reward  version  rollout_s  train_s  tok/s     publish_s  publish_MB  peak GPU GiB (rollout/log-probs/train/publish)")
for r in rows:
    peaks = "/".join(f"{r[PHASE_PEAK_GPU_MEMORY[p][1]]:.2f}" if PHASE_PEAK_GPU_MEMORY[p][1] in r else "-"
                     for p in ("rollout", "log_probs", "train", "publish"))
    print(f"{r['rollout_id']:7d}  {r['reward_mean']:6.3f}  {r['weight_version']:>7}  {r[PHASE_TIMES['rollout']]:9.2f}"
          f"  {r[PHASE_TIMES['train']]:7.2f}  {r.get(Metric.TRAIN_TOKENS_PER_S, 0):8.0f}  {r[PHASE_TIMES['publish']]:9.3f}"
          f"  {r.get(Metric.PUBLISH_BYTES, 0) / 1e6:10.2f}  {peaks}  " + "#" * round(30 * r["reward_mean"]))
first, last = rows[:5], rows[-5:]
mean = lambda part: sum(r["reward_mean"] for r in part) / len(part)
print(f"\nreward: first five rollouts {mean(first):.3f}, last five {mean(last):.3f}")
sys.exit(0 if mean(last) > mean(first) else "the reward did not rise")
PY
echo
echo "plots (slurmrl report): reward and eval per rollout, time per phase, failures on the time axis:"
slurmrl report "$job_dir"
state=$(slurmrl status "$job_dir" --json | python -c 'import json,sys; print(json.load(sys.stdin)["stop_reason"])')
[ "$state" = completed ] || { echo "the job did not complete: $state"; exit 1; }
[ "$rising" = yes ] || { echo "the job completed, but its reward did not rise"; exit 1; }
