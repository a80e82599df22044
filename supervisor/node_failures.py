"""Lost nodes, as the supervisor handles them (supervisor/nodes.py asks SLURM): released from the job
before SLURM marks them DOWN, their engines moved to spare nodes, a node watched closely while an
engine on it is stopped or started again, and a lost trainer node handed to
supervisor/trainer_node_loss.py (save, then requeue without it). Each lost node, with what was done
about it, is kept in the state store (`lost_nodes`: `slurmrl status` shows them)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress

from supervisor.context import JobContext
from supervisor.engine_record import Engine
from supervisor.engine_states import FAILED
from supervisor.nodes import LostNodeWatch, NodeTracker
from supervisor.step_control import Step


class NodeFailures:
    def __init__(self, job: JobContext) -> None:
        self.job = job
        layout, ft = job.layout, job.ft
        self.tracker = NodeTracker(layout.job_id, layout.spare_nodes, keep=layout.trainer_nodes,
                                   timeout_s=ft.slurm_command_timeout)
        self.watch = LostNodeWatch(self.tracker.check, self.node_lost, ft.node_poll_interval)
        self._next_check = 0.0  # monotonic time of the next check_due (monitor thread only)
        # A lost trainer node (node, why) -> what was done about it (TrainerNodeLoss.lost, wired by the daemon).
        self.on_trainer_node_lost: Callable[[str, str], str] = lambda node, why: "nothing: no trainer watch"

    def node_lost(self, node: str, why: str) -> None:
        """The first time a node is seen lost: release it from the job (a trainer node is kept: the
        trainer's own handling decides), report it and keep it in the state store."""
        if not self.tracker.lose(node, why):
            return
        allocation = self.tracker.release(node)
        self.job.events.emit("node_failed", node=node, reason=why, allocation=allocation)
        done = self.on_trainer_node_lost(node, why) if node in self.job.layout.trainer_nodes else allocation
        with self.job.store.update() as state:
            state.lost_nodes[node] = f"{why}: {done}"

    def check_trainer_nodes(self) -> None:
        """The trainer's nodes, now (one query): before a failed trainer is restarted."""
        for node, why in self.tracker.check(self.job.layout.trainer_nodes).items():
            self.node_lost(node, why)

    def check_due(self) -> list[tuple[Engine, str]]:
        """Every node_check_interval, all engine, spare and trainer nodes in one query: a lost engine
        or spare node is released before SLURM marks it DOWN (which would requeue the whole hetjob),
        even one whose engine still answers or that holds no engine yet; a lost trainer node goes to
        on_trainer_node_lost. Returns the engines to recover, and why."""
        if time.monotonic() < self._next_check:
            return []
        self._next_check = time.monotonic() + self.job.ft.node_check_interval
        engines = self.job.engines.values()
        watched = {node for e in engines if e.state != FAILED for node in e.place.nodes}
        watched |= {*self.tracker.spares, *self.job.layout.trainer_nodes}
        out = []
        for node, why in self.tracker.check(sorted(watched)).items():
            self.node_lost(node, why)
            out += [(e, f"its node {node} is lost: {why}") for e in engines if node in e.place.nodes]
        return out

    def place_on_live_node(self, engine: Engine) -> str | None:
        """Before a (re)launch: if a node of the engine is lost, move the engine to the live ones and
        a spare node for each lost one (a fresh start there: not part of a crash loop). Returns a
        lost node when too few spares are left."""
        lost = self.tracker.check(engine.place.nodes)
        if not lost:
            return None
        for node, why in {**lost, **self.tracker.check(self.tracker.spares)}.items():
            self.node_lost(node, why)
        spares = self.tracker.take_spares(len(lost))
        if spares is None:
            return next(iter(lost))
        job, old = self.job, engine.place.nodes
        job.engines.move(engine, job.layout.moved(engine.place, dict(zip(lost, spares))))
        job.events.emit("engine_moved", engine.name, from_nodes=list(old), to_node=spares[0],
                        to_nodes=list(engine.place.nodes), url=engine.url)
        return None

    @contextmanager
    def watching(self, engine: Engine, step: Step) -> Iterator:
        """While in the block, watch the engine's node; once SLURM calls it unusable, release it and
        kill the step's srun (or an adopted step's stand-in), which ends the block's wait on the
        step, and set the event yielded. Seen on a dead node: scancel ends the step's srun after some
        seconds, but an srun launched there again waits for the dead step's CPUs."""
        proc = step.proc
        assert proc is not None  # a launched or adopted step: it has a child
        def kill_srun() -> None:
            with suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)

        with self.watch.watching(engine.place.nodes, kill_srun) as lost:
            yield lost
