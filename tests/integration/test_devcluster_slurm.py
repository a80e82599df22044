"""The devcluster is a real SLURM: hetjobs, GPU gres, batch signals, requeue and accounting."""

from __future__ import annotations

from pathlib import Path

import pytest

from slurm.devcluster import DevCluster
from tests.slurm_helpers import (
    sbatch,
    slurm,
    wait_file_contains,
    wait_job_gone,
    wait_sacct_states,
    write_script,
)

pytestmark = pytest.mark.integration


def test_sinfo_shows_configured_nodes_idle_with_gpu_gres(devcluster: DevCluster) -> None:
    rows = [line.split() for line in slurm("sinfo", "-h", "-N", "-o", "%N %t %G %c").splitlines()]
    shape = devcluster.shape
    assert sorted(r[0] for r in rows) == sorted(shape.node_names)
    for name, state, gres, cpus in rows:
        assert state in ("idle", "mix", "alloc"), f"{name} is {state}"
        assert gres == f"gpu:{shape.gpus_per_node}"
        assert int(cpus) == shape.cpus_per_node


def test_hetjob_steps_run_on_their_own_group_nodes_with_their_own_gpus(devcluster: DevCluster, tmp_path: Path) -> None:
    out = tmp_path / "het.out"
    # Each group takes a whole node, so the two groups cannot share one.
    script = write_script(tmp_path / "het.sh", f"""
#SBATCH --output={out}
#SBATCH --nodes=1 --gres=gpu:2 --exclusive
#SBATCH hetjob
#SBATCH --nodes=1 --gres=gpu:1 --exclusive
echo "alloc 0 $SLURM_JOB_NODELIST_HET_GROUP_0"
echo "alloc 1 $SLURM_JOB_NODELIST_HET_GROUP_1"
srun --het-group=0 --gres=gpu:2 bash -c 'echo "step 0 $SLURMD_NODENAME $CUDA_VISIBLE_DEVICES"'
srun --het-group=1 --gres=gpu:1 bash -c 'echo "step 1 $SLURMD_NODENAME $CUDA_VISIBLE_DEVICES"'
srun --het-group=1 bash -c 'echo "nogpu 1 $SLURMD_NODENAME ${{CUDA_VISIBLE_DEVICES:-none}}"'
""")
    job_id = sbatch(script)
    wait_job_gone(job_id)
    lines = [line.split() for line in out.read_text().splitlines()]
    alloc = {l[1]: l[2] for l in lines if l[0] == "alloc"}
    steps = {l[1]: l[2:] for l in lines if l[0] == "step"}
    assert alloc["0"] != alloc["1"], "the two het groups landed on one node"
    assert steps["0"][0] == alloc["0"] and steps["1"][0] == alloc["1"]
    assert len(steps["0"][1].split(",")) == 2
    assert len(steps["1"][1].split(",")) == 1
    nogpu = next(l for l in lines if l[0] == "nogpu")
    assert nogpu[2] == alloc["1"]
    wait_sacct_states(job_id, {f"{job_id}+0": "COMPLETED", f"{job_id}+1": "COMPLETED"})


def test_scancel_signal_batch_reaches_the_batch_step_handler(devcluster: DevCluster, tmp_path: Path) -> None:
    out = tmp_path / "signal.out"
    script = write_script(tmp_path / "signal.sh", f"""
#SBATCH --output={out}
trap 'echo "got USR1"; kill $!; exit 0' USR1
echo ready
sleep 300 &
wait
echo "wait ended without the signal"
exit 3
""")
    job_id = sbatch(script)
    wait_file_contains(out, "ready")
    slurm("scancel", "--signal=USR1", "--batch", job_id)
    wait_job_gone(job_id)
    assert "got USR1" in out.read_text()
    wait_sacct_states(job_id, ["COMPLETED"])


def test_scontrol_requeue_runs_the_job_again_and_sacct_shows_both_runs(devcluster: DevCluster, tmp_path: Path) -> None:
    out = tmp_path / "requeue.out"
    script = write_script(tmp_path / "requeue.sh", f"""
#SBATCH --output={out} --open-mode=append --requeue
echo "run ${{SLURM_RESTART_COUNT:-0}}"
if [ "${{SLURM_RESTART_COUNT:-0}}" -ge 1 ]; then exit 0; fi
sleep 300 &
wait
""")
    job_id = sbatch(script)
    wait_file_contains(out, "run 0")
    slurm("scontrol", "requeue", job_id)
    wait_file_contains(out, "run 1")
    wait_job_gone(job_id)
    runs = [line for line in out.read_text().splitlines() if line.startswith("run ")]
    assert runs == ["run 0", "run 1"]
    wait_sacct_states(job_id, ["REQUEUED", "COMPLETED"], duplicates=True)
