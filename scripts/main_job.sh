#!/usr/bin/env bash
# The main job: install, bring up the SLURM devcluster (a network namespace per node), make the tiny model and the demo
# task's prompts (the toy task over all ten digits), submit the demo RL job (examples/demo_job.yaml:
# supervisor, router, 2 CPU engines, trainer as steps of one heterogeneous job; its reward climbs
# for its 60 rollouts), show its status while it runs, and the reward per rollout at the end,
# then write the job's plots (slurmrl report) and print where they are.
# Idempotent; the devcluster stays up (`slurmrl cluster down`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
# A network namespace per node; shared loopback where this machine does not allow namespaces. Fake
# GPUs even on a GPU machine: the demo runs on CPUs (scripts/gpu_job.sh is its GPU twin).
if ! up=$(slurmrl cluster up --isolated --gpus fake 2>&1); then
    grep -q "network namespaces are not allowed here" <<<"$up" || { echo "$up" >&2; exit 1; }
    echo "$up"
    slurmrl cluster up --shared-loopback --gpus fake
else
    echo "$up"
fi
eval "$(slurmrl cluster status | grep '^  export SLURM_CONF=')"
work=${SLURMRL_DEMO_DIR:-/tmp/slurmrl-demo}
mkdir -p "$work"
[ -f "$work/model/config.json" ] || slurmrl tiny-model "$work/model"
[ -f "$work/demo.jsonl" ] || slurmrl toy-data "$work/demo.jsonl" --labels 0123456789
job_dir="$work/job-$(date +%Y%m%d-%H%M%S)"
job_id=$(slurmrl submit examples/demo_job.yaml --json --job-dir "$job_dir" \
    --hf-checkpoint "$work/model" --prompt-data "$work/demo.jsonl" | python3 -c 'import json,sys; print(json.load(sys.stdin)["job_id"])')
echo "submitted job $job_id; job directory $job_dir"
while squeue -h -j "$job_id" -o %i | grep -q .; do
    [ -f "$job_dir/supervisor_state.json" ] && { echo; slurmrl status "$job_dir" || true; }
    sleep 5
done
echo
slurmrl status "$job_dir"  # the final table, once
python3 - "$job_dir/metrics.jsonl" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
print("\nrollout  reward  generated at weight version")
for r in rows:
    print(f"{r['rollout_id']:7d}  {r['reward_mean']:6.3f}  {r['weight_version']:>6}  " + "#" * round(40 * r["reward_mean"]))
PY
echo
echo "plots (slurmrl report): reward and eval per rollout, time per phase, failures on the time axis:"
slurmrl report "$job_dir"
state=$(slurmrl status "$job_dir" --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["stop_reason"])')
[ "$state" = completed ] || { echo "the job did not complete: $state"; exit 1; }
