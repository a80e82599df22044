"""What the supervisor starts for a --debug-train-only job: its layout has no rollout node and no
engine (SLURM gives the job one het group), and the trainer's step is told of no router and releases
no engine memory; with no engine there is nothing to probe, recover or publish to."""

from __future__ import annotations

from pathlib import Path

import pytest

from contract.spec import JobSpec, RolloutSpec, StepsSpec, TrainerSpec
from slurm.client import SlurmClient
from supervisor import layout
from supervisor.launcher import ROUTER, TRAINER
from tests.supervisor.test_step_options import site_launcher

DEBUG_TRAIN_ONLY = ["--hf-checkpoint", "/m", "--debug-train-only", "--load-debug-rollout-data", "/d/{rollout_id}.pt"]


def test_the_layout_has_the_trainer_nodes_and_no_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(SlurmClient, "hostnames", lambda self, nodelist: nodelist.split(","))
    monkeypatch.setattr(layout, "node_addresses", lambda names, timeout_s: {n: "10.0.0.1" for n in names})
    env = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "t0"}  # a job of one group: no _HET_GROUP_ variables
    spec = JobSpec(trainer=TrainerSpec(train_args=DEBUG_TRAIN_ONLY), rollout=RolloutSpec(engine="cpu", num_engines=2))
    lay = layout.from_environment(spec, 1.0, env)
    assert (lay.trainer_nodes, lay.rollout_nodes, lay.engines, lay.spare_nodes) == (("t0",), (), (), ())


@pytest.mark.parametrize("colocate", [False, True])
def test_the_trainer_step_gets_no_router_and_releases_no_engine_memory(tmp_path: Path, colocate: bool) -> None:
    rollout = RolloutSpec(engine="cpu", num_engines=2, colocate=colocate)
    launcher, steps, job = site_launcher(tmp_path, StepsSpec(), rollout, [], ())
    try:
        job.spec.trainer.train_args = list(DEBUG_TRAIN_ONLY)
        launcher.launch_trainer()
        [spec] = steps.specs
        assert spec.name == TRAINER and spec.het_group is None  # one group: no --het-group
        argv = list(spec.argv)
        assert not [a for a in argv if a.startswith("--sglang-router") or a == "--offload-rollout"], argv
        assert ("--offload-train" in argv) == colocate  # slime: --colocate offloads the trainer all the same
        assert launcher.current(ROUTER) is None
    finally:
        job.events.close()

