#!/usr/bin/env bash
# The GPU job tests (issue 30, item 4: tests/gpu/test_gpu_job.py, and the engine on a GPU,
# tests/gpu/test_gpu_engine.py) on the device, one machine kind per call, each well within the
# device's 10 minutes a call. PART picks what the kind is for (the tests that need more GPUs than
# the machine has skip themselves, saying so):
#   PART=one   the engine on a GPU; --colocate on one GPU for 20 rollouts (d)
#   PART=two   2 GPUs: trainer on one, two engines on the other (e); NCCL weights into a GPU engine; the
#              only engine SIGKILLed in a rollout over NCCL (a)
#   PART=resume  2 GPUs: preemption and exact resume (c): two jobs, the uninterrupted and the preempted
#   PART=four  4 GPUs: the trainer at DP=2 and two engines, an engine and the trainer SIGKILLed (e, a, b)
# e.g. run(kind="nvidia-h100-x2", command="PART=two bash scripts/gpu_job_tests.sh", carry=[".whl", ".debs"],
#          timeout_s=600)
# SLURM and munge come from the carried .deb files (.debs/, `bash scripts/fetch_slurm_debs.sh` where apt
# works); wheels the machine lacks from .whl/. Logs, junit XML and each test's figures and events
# (gpu_job/*.json) go to $OUT, and where pytest fails, the jobs' text logs (failed_logs.tgz). LIMIT (seconds) bounds the pytest run; SELECT replaces PART's -k expression.
cd "$(dirname "$0")/.."
if compgen -G ".whl/*.whl" > /dev/null; then python -m pip install -q --no-deps .whl/*.whl 2>&1 | tail -2; fi
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/gpu_job_tests}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # the device's KINDS.md
mkdir -p "$OUT"
nvidia-smi -L || true
case "${PART:-all}" in
    one) select="test_gpu_engine and not nccl or colocated" ;;
    two) select="two_gpus or nccl_weights or only_engine" ;;
    resume) select="preempted" ;;
    four) select="four_gpus" ;;
    all) select="" ;;
    *) echo "PART must be one, two, resume, four or all, got ${PART}" >&2; exit 2 ;;
esac
select=${SELECT:-$select}  # SELECT: a -k expression of one's own (several parts on one machine)
began=$SECONDS
timeout -s INT -k 20 "${LIMIT:-570}" python -m pytest tests/gpu/test_gpu_engine.py tests/gpu/test_gpu_job.py \
    ${select:+-k "$select"} -v -p no:cacheprovider -p no:randomly -rfEs --tb=short -o timeout=560 --durations=0 \
    --basetemp /tmp/gpu_job_bt --junitxml="$OUT/gpu_job_tests.xml" > "$OUT/gpu_job_tests.txt" 2>&1
rc=$?
if [ "$rc" != 0 ]; then  # the jobs' logs, events and supervisor state: text under 4 MB each, no checkpoints
    (cd /tmp/gpu_job_bt && find . -type f -size -4M \( -name "*.out" -o -name "*.err" -o -name "*.log" \
        -o -name "*.jsonl" -o -name "*.json" -o -name "*.txt" \) -print0 | tar -czf "$OUT/failed_logs.tgz" --null -T -)
fi
echo "pytest rc=$rc after $((SECONDS - began)) s"
grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|skipped" "$OUT/gpu_job_tests.txt" | cut -c1-250 | tail -30
ls "$OUT"/gpu_job 2>/dev/null
exit $rc
