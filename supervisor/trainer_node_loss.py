"""A lost trainer node (issue 29, item 3). NodeFailures watches the trainer's nodes together with
the engines' (one query every node_check_interval), and looks at them again before a failed trainer
would be restarted; a lost one comes here. A trainer that still runs is told to save now (the
preemption's path, supervisor/requeue.py), else the job goes on from its last checkpoint and the
rollout journal; either way the job is requeued without the node (ExcNodeList), and no trainer
restart is spent on it: a relaunch onto the same nodes can only fail.

Seen on slurm 22.05 (the devcluster, SlurmdTimeout=30), a two-node trainer whose second node's
slurmd is killed: the node is NOT_RESPONDING some 20 s later and DOWN some 45 s later. At DOWN SLURM
takes the node out of the trainer's --no-kill component (it shrinks; the job is not requeued) and
ends the trainer step; a relaunch onto both nodes then fails ("Requested node configuration is not
available"). Until that DOWN the trainer's srun waits for the lost node's tasks, even when the
trainer has saved and ended (their slurmstepd cannot report through the dead slurmd); with the node's
processes dead too, rank 0 fails at once (gloo: "Connection closed by peer") and its srun waits on
(seen: minutes after the DOWN). So the step is ended here: once the trainer's save is complete (the
checkpoint tracker rewritten since the loss), or once it has shown no sign of life (a heartbeat) for
twice a rollout and a save, as the last ones took (it cannot save: a rank is gone or hung). Its
srun is killed (the requeue that follows ends whatever of the step is left); its exit reaches the
monitor, which requeues. A requeue with ExcNodeList asks for the component's whole node count
again, on other nodes.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from ckpt_tools.tracker import TRACKER
from contract.job_dir import read_heartbeat
from supervisor.context import JobContext
from supervisor.launcher import TRAINER, StepLauncher
from supervisor.node_failures import NodeFailures
from supervisor.requeue import Requeue
from supervisor.step_control import Step, StepControl

# The least a trainer is given to show life after its node is lost (twice a rollout and a save, as
# measured, when that is longer). A live one beats at once: told to save now, it abandons its rollout
# and enters its save; before its first rollout nothing is lost by ending it.
MIN_SIGN_OF_LIFE_S = 10.0


class TrainerNodeLoss:
    """Registers itself with `nodes` (on_trainer_node_lost); the monitor thread calls exited() and
    follow_up(); lost() may come from any thread that finds a node lost."""

    def __init__(self, job: JobContext, nodes: NodeFailures, launcher: StepLauncher, steps: StepControl,
                 requeue: Requeue) -> None:
        self.job = job
        self.nodes = nodes
        self.launcher = launcher
        self.steps = steps
        self.requeue = requeue
        self._lost = threading.Event()  # a trainer node was lost: the job requeues without it
        self._lost_at = 0.0  # unix time of the first loss
        self._tracker_at_loss: tuple[int, int] | None = None  # the checkpoint tracker's file then
        self._ended = False  # the step was ended here (monitor thread only)
        nodes.on_trainer_node_lost = self.lost

    def lost(self, node: str, why: str) -> str:
        """A trainer node seen lost for the first time: save if the trainer runs, then requeue
        without the node. Says what is done."""
        step = self.launcher.current(TRAINER)
        if step is not None and step.returncode is None:
            done = f"the trainer is told to save now (ended if it cannot), then the job requeues without {node}"
        else:
            done = f"the job requeues without {node}, from the last checkpoint and the rollout journal"
        if not self._lost.is_set():
            self._lost_at, self._tracker_at_loss = time.time(), self._tracker()
        self._lost.set()
        self.job.events.emit("trainer_node_lost", TRAINER, node=node, reason=why, action=done)
        self.requeue.without_node(node, f"trainer node {node} is lost: {why}; requeue without it")
        return done

    def exited(self, step: Step) -> None:
        """The trainer step ended. Before its exit is judged (a failed trainer is restarted): if it
        failed and one of its nodes is lost, the job requeues instead (TrainerWatch.on_exit spends
        no restart once a requeue is decided)."""
        if step.returncode != 0 and self.requeue.preemption.reason is None:
            self.nodes.check_trainer_nodes()

    def follow_up(self) -> None:
        """Each monitor cycle once a trainer node is lost, until the trainer step ends: ended here
        once it has saved, or once it has been silent too long to still save."""
        if not self._lost.is_set() or self._ended:
            return
        step = self.launcher.current(TRAINER)
        if step is None or step.returncode is not None:
            return
        if self._tracker() != self._tracker_at_loss:
            self._end(step, "it saved after its node was lost")
            return
        beat = read_heartbeat(self.job.dir, self._lost_at)  # (a save beats as it makes progress)
        silent_s = time.time() - max(self._lost_at, beat.time)
        bound_s = max(2 * self.requeue.pace.costs(beat).boundary_s, MIN_SIGN_OF_LIFE_S)
        if silent_s > bound_s:
            self._end(step, f"no heartbeat for {silent_s:.0f} s since its node was lost (bound {bound_s:.0f} s: "
                            "twice a rollout and a save): it cannot save; the job resumes from the last checkpoint")

    def _end(self, step: Step, why: str) -> None:
        """Kill the step's srun (it would wait for the lost node's tasks); the requeue that its exit
        brings ends what is left of the step."""
        self._ended = True
        self.job.events.emit("trainer_abandoned", TRAINER, slurm_step=step.slurm_step, reason=why)
        self.steps.abandon(step, self.job.ft.step_term_grace)

    def _tracker(self) -> tuple[int, int] | None:
        """The checkpoint tracker file (inode, mtime): every save rewrites it, atomically."""
        save = self.job.spec.trainer.save
        try:
            found = os.stat(Path(save) / TRACKER) if save else None
        except OSError:
            return None
        return (found.st_ino, found.st_mtime_ns) if found else None
