"""--colocate on the devcluster (4 fake GPUs per node, via gres): the engine steps the launcher
asks for (--overlap, the node's whole GPU list: tests/jobs/test_colocation.py) start while the
trainer's step holds every GPU of the node, and see the same GPU list as the trainer (each engine
then takes its slice with SGLang's --base-gpu-id). Without --overlap the same step waits for the
trainer to end ("Requested nodes are busy"): what colocated engines did before."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from slurm.devcluster import DevCluster
from slurm.devcluster.daemons import wait_for
from supervisor.steps import StepController, StepSpec
from tests.slurm_helpers import sbatch, slurm, wait_file_contains, wait_job_gone, write_script

QUERY_S, EXIT_CODE_S = 20.0, 30.0
GPUS = 4
PENDING_LOOK_S = 3.0  # how long the step without --overlap is watched still waiting


@pytest.fixture
def gpu_job(devcluster: DevCluster, tmp_path: Path) -> Iterator[tuple[str, str]]:
    script = write_script(tmp_path / "job.sh", f"""
#SBATCH --output={tmp_path}/batch.out --time=5
#SBATCH --nodes=1 --ntasks={GPUS} --cpus-per-task=1 --gres=gpu:{GPUS}
sleep 600
""")
    job_id = sbatch(script)
    try:
        def node() -> str:
            return "".join(slurm("squeue", "-h", "-j", job_id, "-t", "R", "-o", "%N").split())

        wait_for(lambda: bool(node()), 60, f"job {job_id} to run")
        yield job_id, node()
    finally:
        slurm("scancel", job_id)
        wait_job_gone(job_id, timeout_s=60)


def test_colocated_engine_steps_start_beside_the_trainer_and_share_its_gpus(gpu_job: tuple[str, str],
                                                                            tmp_path: Path) -> None:
    job_id, node = gpu_job
    steps = StepController(job_id, QUERY_S, EXIT_CODE_S)
    done = tmp_path / "trainer.done"
    trainer = steps.launch(StepSpec(
        "trainer", ("bash", "-c", f'echo "rank $SLURM_PROCID gpus=$CUDA_VISIBLE_DEVICES"; '
                                  f'until [ -e {done} ]; do sleep 0.1; done'),
        (node,), tmp_path / "trainer.log", ntasks=GPUS, gpus_per_node=GPUS, cpus_per_task=1))
    try:
        wait_file_contains(tmp_path / "trainer.log", f"rank {GPUS - 1} gpus=", timeout_s=60)
        blocked = steps.launch(StepSpec("blocked", ("bash", "-c", "echo started"), (node,), tmp_path / "blocked.log",
                                        gpus_per_node=GPUS, cpus_per_task=1))
        engines = [steps.launch(StepSpec(f"engine-{k}", ("bash", "-c", 'echo "gpus=$CUDA_VISIBLE_DEVICES"'), (node,),
                                         tmp_path / f"engine-{k}.log", gpus_per_node=GPUS, cpus_per_task=1,
                                         overlap=True)) for k in range(2)]
        for engine in engines:
            assert engine.proc.wait(60) == 0
        assert trainer.returncode is None  # both ran at once
        for k in range(2):
            assert "gpus=0,1,2,3" in (tmp_path / f"engine-{k}.log").read_text()
        assert (tmp_path / "trainer.log").read_text().count("gpus=0,1,2,3") == GPUS
        time.sleep(PENDING_LOOK_S)
        assert blocked.returncode is None and "started" not in (tmp_path / "blocked.log").read_text()
        done.touch()
        assert trainer.proc.wait(60) == 0
        assert blocked.proc.wait(60) == 0  # it starts once the trainer's GPUs are free
    finally:
        done.touch()
        steps.close()
