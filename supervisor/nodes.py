"""Node failures (issue 7, item 4): which of the allocation's nodes SLURM calls unusable, the spare
nodes left, and taking a lost node out of the job.

SLURM is asked in one batched call for any set of nodes; a failed or slow query answers "unknown"
(nothing lost), never "down", so a slurmctld that does not answer moves no engine.

Seen on slurm 22.05 (the devcluster: SlurmdTimeout=30) when a node's slurmd dies: the node shows
NOT_RESPONDING (`State=MIXED+NOT_RESPONDING`) 10-30 s later and DOWN 10-25 s after that. The
sruns of its steps do not exit (they wait on slurmctld) until scancel, some seconds after which they
give up (the steps stay listed), and an srun launched onto the node again waits for the dead steps'
CPUs instead of failing. Once DOWN, the node ends a hetjob (requeued,
--no-kill or not: see jobs/hetjob.py), so a lost node is released first: `scontrol update
JobId=COMPONENT NodeList=REST` is taken while the job runs (SLURM kills the job's steps on the node),
after which the DOWN touches no job, an srun onto the node fails at once, and one onto a spare node
of the allocation starts at once. ExcNodeList is refused while the job runs ("Job is no longer
pending execution"); right after a requeue it is taken, and set on the leader it applies to every
component.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from slurm.client import SlurmClient, SlurmUnavailable

# Base states and flags (`scontrol show node`'s State=BASE+FLAG+...) of a node no step can run on.
UNUSABLE_STATES = {"DOWN", "ERROR", "FUTURE"}
UNUSABLE_FLAGS = {"NOT_RESPONDING", "DRAIN", "FAIL", "POWERED_DOWN", "POWERING_DOWN", "REBOOT_ISSUED"}
_REASON = re.compile(r"\bReason=(.*?)(?=\s+\w+=|$)")
_EXCLUDE_RETRY_S = 0.5  # between two asks for ExcNodeList (SLURM takes it once the requeue is through)


def _scontrol(slurm: SlurmClient, *args: str) -> str | None:
    """scontrol's output, or None when it failed or did not answer in time."""
    done = slurm.call("scontrol", *args)
    return done.stdout if done.ok else None


def _fields(line: str) -> dict[str, str]:
    return dict(part.split("=", 1) for part in line.split() if "=" in part)


def _hosts(slurm: SlurmClient, nodelist: str | None) -> list[str]:
    return [] if nodelist is None or nodelist in ("", "(null)") else slurm.hostnames(nodelist)


def unusable(nodes: Collection[str], slurm: SlurmClient) -> dict[str, str] | None:
    """{node: its state and reason} for those of `nodes` SLURM says cannot run a step now; None when
    SLURM did not answer."""
    if not nodes:
        return {}
    out = _scontrol(slurm, "show", "node", "-o", ",".join(nodes))
    if out is None:
        return None
    bad = {}
    for line in out.splitlines():
        fields = _fields(line)
        base, *flags = fields.get("State", "").replace("*", "+NOT_RESPONDING").split("+")
        if base in UNUSABLE_STATES or UNUSABLE_FLAGS.intersection(flags):
            reason = _REASON.search(line)
            bad[fields["NodeName"]] = fields["State"] + (f" ({reason.group(1)})" if reason else "")
    return bad


class NodeTracker:
    """The job's lost nodes and spare nodes (shared by the supervisor's recovery threads)."""

    def __init__(self, job_id: str, spares: Iterable[str], keep: Collection[str], timeout_s: float) -> None:
        """timeout_s: one scontrol call."""
        self.job_id = job_id
        self.keep = set(keep)  # never released: the trainer's nodes, the supervisor's among them
        self.slurm = SlurmClient(timeout_s)
        self._lost: dict[str, str] = {}  # node -> why
        self._spares = list(spares)
        self._lock = threading.Lock()

    @property
    def spares(self) -> tuple[str, ...]:
        with self._lock:
            return tuple(self._spares)

    def check(self, nodes: Collection[str]) -> dict[str, str]:
        """{node: why} for those of `nodes` already lost or that SLURM now calls unusable."""
        with self._lock:
            known = {node: self._lost[node] for node in nodes if node in self._lost}
        return {**known, **(unusable([n for n in nodes if n not in known], self.slurm) or {})}

    def lose(self, node: str, why: str) -> bool:
        """Record `node` as lost (no longer a spare); True only the first time."""
        with self._lock:
            if node in self._lost:
                return False
            self._lost[node] = why
            if node in self._spares:
                self._spares.remove(node)
            return True

    def take_spares(self, count: int) -> list[str] | None:
        """`count` spare nodes, no longer spare from now on; None (and none taken) when fewer are left."""
        with self._lock:
            if len(self._spares) < count:
                return None
            taken, self._spares = self._spares[:count], self._spares[count:]
            return taken

    def release(self, node: str) -> str:
        """Take `node` out of the job's allocation before SLURM marks it DOWN; says what happened."""
        if node in self.keep:
            return "kept: it runs the trainer"
        out = _scontrol(self.slurm, "show", "job", "-o", self.job_id)
        for fields in map(_fields, (out or "").splitlines()):
            nodes = _hosts(self.slurm, fields.get("NodeList"))
            if node not in nodes:
                continue
            rest = [n for n in nodes if n != node]
            if not rest:
                return f"kept: the last node of job {fields['JobId']}"
            done = _scontrol(self.slurm, "update", f"JobId={fields['JobId']}", f"NodeList={','.join(rest)}")
            return f"released from job {fields['JobId']}" if done is not None else "kept: scontrol update failed"
        return "kept: SLURM did not answer" if out is None else "not in the job"

    def exclude(self, nodes: Collection[str], deadline_s: float) -> bool:
        """Keep the requeued job off `nodes` (and what it excluded already) when it starts again.
        Call it right after the requeue: SLURM takes no ExcNodeList while the job runs, so it is
        asked again until it does or `deadline_s` has passed."""
        deadline = time.monotonic() + deadline_s
        while not self._try_exclude(set(nodes)):
            if time.monotonic() > deadline:
                return False
            time.sleep(_EXCLUDE_RETRY_S)
        return True

    def _try_exclude(self, nodes: set[str]) -> bool:
        out = _scontrol(self.slurm, "show", "job", "-o", self.job_id)
        if out is None:
            return False
        try:
            excluded = {n for line in out.splitlines() for n in _hosts(self.slurm, _fields(line).get("ExcNodeList"))}
        except SlurmUnavailable:
            return False
        if nodes <= excluded:
            return True
        update = _scontrol(self.slurm, "update", f"JobId={self.job_id}",
                           f"ExcNodeList={','.join(sorted(excluded | nodes))}")
        return update is not None


@dataclass
class _Watch:
    nodes: tuple[str, ...]
    on_lost: Callable[[], None]
    lost: threading.Event = field(default_factory=threading.Event)


class LostNodeWatch:
    """Nodes watched closely while their engines are stopped or started (a restart waits on them):
    one thread and one batched query every `interval_s` over all of them, however many engines
    restart at once. A lost node goes to `on_node_lost`; every block watching it gets its
    `on_lost` called once (while still in the block) and its event set."""

    def __init__(self, check: Callable[[list[str]], dict[str, str]], on_node_lost: Callable[[str, str], None],
                 interval_s: float) -> None:
        self._check = check
        self._on_node_lost = on_node_lost
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._watches: dict[int, _Watch] = {}
        self._thread: threading.Thread | None = None  # runs while there is something to watch

    @property
    def running(self) -> bool:
        with self._lock:
            return self._thread is not None

    @contextmanager
    def watching(self, nodes: Iterable[str], on_lost: Callable[[], None]) -> Iterator[threading.Event]:
        watch = _Watch(tuple(nodes), on_lost)
        with self._lock:
            self._watches[id(watch)] = watch
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="node-watch", daemon=True)
                self._thread.start()
        try:
            yield watch.lost
        finally:
            with self._lock:
                del self._watches[id(watch)]

    def _run(self) -> None:
        while True:
            time.sleep(self.interval_s)
            with self._lock:
                nodes = sorted({node for watch in self._watches.values() for node in watch.nodes})
                if not nodes:
                    self._thread = None
                    return
            lost = self._check(nodes)
            for node, why in lost.items():
                self._on_node_lost(node, why)
            with self._lock:  # only blocks still open: one that has ended is not called back
                for watch in self._watches.values():
                    if not watch.lost.is_set() and any(node in lost for node in watch.nodes):
                        watch.lost.set()
                        watch.on_lost()
