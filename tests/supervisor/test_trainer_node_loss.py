"""A lost trainer node (supervisor/trainer_node_loss.py) against the local step backend: the trainer
step is a plain process, SLURM's node states come from the test. A node of a running trainer found
lost by the node check: the job requeues without it and the trainer is left to save; its srun is
killed once the save is complete, or once the trainer stayed silent too long to still save. A
trainer that failed with its node is requeued, not restarted. (On SLURM:
tests/integration/test_trainer_node_loss.py.)"""

from __future__ import annotations

import dataclasses
import json
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ckpt_tools.tracker import write_tracker
from contract.spec import FaultToleranceSpec, JobSpec, RolloutSpec, TrainerSpec
from slurm.client import Reply
from supervisor import nodes, trainer_node_loss
from supervisor.context import JobContext
from supervisor.launcher import TRAINER
from supervisor.local_steps import LocalSteps
from supervisor.requeue import REQUEUE
from supervisor.trainer_node_loss import TrainerNodeLoss
from tests.supervisor.job_context import two_engine_job
from tests.supervisor.recovery_wiring import Wiring, wire_recovery

ROOT = Path(__file__).resolve().parents[2]
TRAINER_NODES = ("n0", "n3")
EXIT_S = 10.0  # a killed or finished step's exit reaching the inbox
STATUS_S = 60.0  # `slurmrl status` answering (its imports)

Wired = tuple[JobContext, Wiring, TrainerNodeLoss, dict[str, str]]


@pytest.fixture
def wired(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Wired]:
    """The supervisor's parts over local steps, a two-node trainer on n0 and n3, and the nodes SLURM
    calls unusable (a dict the test fills)."""
    ft = FaultToleranceSpec(use_fault_tolerance=True, restart_backoff=0.0, slurm_command_timeout=5.0,
                            step_stop_timeout=5.0, step_term_grace=2.0)
    spec = JobSpec(job_dir=str(tmp_path / "job"), rollout=RolloutSpec(engine="cpu", num_engines=2), fault_tolerance=ft,
                   trainer=TrainerSpec(train_args=["--save", str(tmp_path / "checkpoints")]))
    job, router = two_engine_job(spec, head="n0", node="n1", het_group=1)
    job = dataclasses.replace(job, layout=dataclasses.replace(job.layout, trainer_nodes=TRAINER_NODES))
    wiring = wire_recovery(job, router, LocalSteps(job.layout.job_id, tmp_path / "steps", on_exit=job.inbox.put))
    loss = TrainerNodeLoss(job, wiring.recovery.nodes, wiring.launcher, wiring.steps, wiring.trainer.requeue)
    unusable: dict[str, str] = {}
    monkeypatch.setattr(nodes, "unusable", lambda names, slurm: {n: why for n, why in unusable.items() if n in names})
    try:
        yield job, wiring, loss, unusable
    finally:
        wiring.stop()
        job.events.close()
        job.client.close()


def _events(job: JobContext, kind: str) -> list[dict[str, Any]]:
    return [e for e in map(json.loads, job.dir.events.read_text().splitlines()) if e["kind"] == kind]


def test_a_lost_trainer_node_requeues_the_job_and_a_silent_trainer_is_ended(
        wired: Wired, monkeypatch: pytest.MonkeyPatch) -> None:
    job, wiring, loss, unusable = wired
    step = wiring.launcher.launch(TRAINER, "trainer", ["sleep", "60"], TRAINER_NODES, 0)
    requeue = wiring.trainer.requeue

    unusable["n3"] = "MIXED+NOT_RESPONDING"
    assert wiring.recovery.nodes.check_due() == []  # no engine on it
    [lost] = _events(job, "trainer_node_lost")
    assert lost["node"] == "n3" and lost["reason"] == "MIXED+NOT_RESPONDING" and "save now" in lost["action"], lost
    assert job.store.snapshot().lost_nodes == {"n3": f"MIXED+NOT_RESPONDING: {lost['action']}"}
    assert requeue.preemption.reason is not None and "trainer node n3 is lost" in requeue.preemption.reason

    loss.follow_up()  # no checkpoint yet, not silent for long: the trainer is left to save
    assert step.returncode is None and not _events(job, "trainer_abandoned")
    # Silent past the bound (rank 0 died with its peer, or hangs on it): it cannot save; its srun,
    # which would wait for the lost node's task, is killed.
    monkeypatch.setattr(trainer_node_loss, "MIN_SIGN_OF_LIFE_S", 0.0)
    loss.follow_up()
    assert job.inbox.get(timeout=EXIT_S) is step and step.returncode == -signal.SIGKILL
    [stopped] = _events(job, "trainer_abandoned")
    assert "cannot save" in stopped["reason"], stopped

    loss.exited(step)
    assert wiring.trainer.on_exit(step) == REQUEUE
    assert wiring.trainer.restarts == 0 and wiring.launcher.current(TRAINER) is step  # nothing relaunched
    assert len(_events(job, "trainer_node_lost")) == 1  # seen once


def test_a_trainer_that_failed_with_its_node_is_requeued_not_restarted(wired: Wired) -> None:
    job, wiring, loss, unusable = wired
    step = wiring.launcher.launch(TRAINER, "trainer", ["sh", "-c", "exit 1"], TRAINER_NODES, 0)
    assert job.inbox.get(timeout=EXIT_S) is step and step.returncode == 1

    loss.exited(step)  # its nodes are all fine: a failure of its own, left to the restart
    assert wiring.trainer.requeue.preemption.reason is None and not _events(job, "trainer_node_lost")

    unusable["n3"] = "DOWN+NOT_RESPONDING (Not responding)"
    loss.exited(step)
    [lost] = _events(job, "trainer_node_lost")
    assert lost["node"] == "n3" and "from the last checkpoint and the rollout journal" in lost["action"], lost
    assert wiring.trainer.on_exit(step) == REQUEUE
    assert wiring.trainer.restarts == 0 and wiring.launcher.current(TRAINER) is step  # nothing relaunched
    assert not _events(job, "trainer_restarted")
    job.spec.write(job.dir.spec)  # (what `slurmrl status` finds the job by)
    shown = subprocess.run([sys.executable, "-m", "jobs.cli", "status", str(job.dir.root)], capture_output=True,
                           text=True, timeout=STATUS_S, cwd=ROOT, stdin=subprocess.DEVNULL)
    assert shown.returncode == 0, shown.stderr
    assert f"node n3 lost: DOWN+NOT_RESPONDING (Not responding): {lost['action']}" in shown.stdout, shown.stdout


def test_a_trainer_that_saved_after_losing_a_node_is_ended_at_once(wired: Wired, tmp_path: Path) -> None:
    """Its srun would wait for the lost node's task until SLURM sets the node DOWN: once the save is
    complete (the checkpoint tracker rewritten), its srun is killed and the job requeues."""
    job, wiring, loss, unusable = wired
    write_tracker(tmp_path / "checkpoints", 4)  # an earlier checkpoint
    step = wiring.launcher.launch(TRAINER, "trainer", ["sleep", "60"], TRAINER_NODES, 0)
    unusable["n3"] = "MIXED+NOT_RESPONDING"
    wiring.recovery.nodes.check_due()
    loss.follow_up()
    assert step.returncode is None and not _events(job, "trainer_abandoned")  # still to save

    write_tracker(tmp_path / "checkpoints", 4)  # the save-now checkpoint (of the rollout saved already: same number)
    loss.follow_up()
    assert job.inbox.get(timeout=EXIT_S) is step and step.returncode == -signal.SIGKILL
    [stopped] = _events(job, "trainer_abandoned")
    assert "saved" in stopped["reason"], stopped
    loss.exited(step)
    assert wiring.trainer.on_exit(step) == REQUEUE and wiring.trainer.restarts == 0


@pytest.mark.parametrize("stderr, taken", [
    # slurmctld signalled the step; only the lost node's slurmd did not answer: asking again reaches no more
    ("scancel: error: Kill job error on job step id 7.3: Communication connection failure\n", True),
    # refused: the signal reached no task (a later cycle asks again, or kills the trainer otherwise)
    ("scancel: error: Kill job error on job step id 7.3: Invalid job id specified\n", False),
    ("scancel: error: Kill job error on job step id 7.3: Protocol authentication error\n", False),
])
def test_a_signal_only_a_lost_node_missed_counts_as_sent(wired: Wired, monkeypatch: pytest.MonkeyPatch,
                                                         stderr: str, taken: bool) -> None:
    job, wiring, loss, unusable = wired
    wiring.launcher.launch(TRAINER, "trainer", ["sleep", "60"], TRAINER_NODES, 0)
    requeue = wiring.trainer.requeue
    monkeypatch.setattr(requeue.slurm, "call", lambda *argv, **kw: Reply("scancel", 1, "", stderr))
    assert requeue.signal_trainer("USR1") is taken
