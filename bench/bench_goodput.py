"""Goodput on the devcluster: the toy job under a failure schedule against the same job without
failures, both run by this process (issue 17 item 5).

The toy job runs with a slow reward model (about 1.4 s a rollout: bench_resume's pace), 40
rollouts, --save-interval 5 and a spare rollout node. One run has no failure; the other gets, once
the given number of rollouts is done and every engine is healthy again:

    6  engine kill:    SIGKILL engine-0's server
    12 engine hang:    SIGSTOP engine-1's server (its probes time out; the supervisor replaces it;
                       SIGCONT after HANG_S if it is still there)
    18 node loss:      engine-0's node (its slurmd and the engine's step) dies; spare node
                       (the node's slurmd is started again once the engine has moved:
                       the requeue below needs all 4 devcluster nodes)
    25 preemption:     SLURM's warning signal (scancel --batch --signal=USR1): save, requeue
    32 trainer kill:   SIGKILL trainer rank 0: in-job restart from the latest checkpoint

From events.jsonl (weights_published, one per rollout: a version above every earlier one is new
progress) and trainer.log ("next rollout N" at each trainer start):
- wall: first supervisor start to the trainer's finish; requeue hold: from the supervisor's
  `requeue` event to the requeued job's supervisor start (SLURM's own hold), reported apart.
- progress time: the time between consecutive new versions, each capped at the failure-free
  run's median gap (anything above it is time lost); ETTR = progress time / wall.
- rate ratio: the failure-free run's progress per second over this run's outside the hold.
- work lost per failure: rollouts done again after it (versions published a second time after
  a rollout, not the resume's first publish).

    PYTHONPATH=. python -m bench.bench_goodput [--workdir DIR]   # devcluster up; as root
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from bench.bench_resume import engine_0, kill_engine_0_node, rollout_ids, submit, trainer_rank0
from rollout.tiny_model import write_tiny_model
from rollout.toy_task import write_toy_data
from slurm.devcluster import DevCluster
from slurm.devcluster.config import DEFAULT_ROOT
from slurm.devcluster.daemons import wait_for
from tests.integration.test_rl_job import listening_pid
from tests.slurm_helpers import wait_job_gone

ROLLOUTS = 40
FLAGS = ("--num-rollout", str(ROLLOUTS), "--rollout-spare-nodes", "1")
HANG_S = 60  # a hung engine the supervisor has not replaced by then is let go on (SIGCONT)
FAILURE_WAIT_S = 300  # bound for each failure's trigger, and for the job's end after the last one
JOB_END_S = 600


def engine_pid(job_dir: Path, name: str) -> int:
    state = json.loads((job_dir / "supervisor_state.json").read_text())["steps"][name]
    return listening_pid(state["url"])


def all_engines_healthy(job_dir: Path) -> bool:
    try:
        steps = json.loads((job_dir / "supervisor_state.json").read_text())["steps"]
    except (OSError, ValueError):
        return False
    return all(s["state"] == "healthy" for s in steps.values() if s["kind"] == "engine")


def hang_engine_1(job_id: str, job_dir: Path) -> None:
    pid = engine_pid(job_dir, "engine-1")
    os.kill(pid, signal.SIGSTOP)
    HUNG.append((pid, time.time()))


HUNG: list[tuple[int, float]] = []
SCHEDULE: list[tuple[int, str, Callable[[str, Path], None]]] = [
    (6, "engine kill", lambda job, d: os.kill(listening_pid(engine_0(d)["url"]), signal.SIGKILL)),
    (12, "engine hang", hang_engine_1),
    (18, "node loss", lambda job, d: kill_engine_0_node(d)),
    (25, "preemption", lambda job, d: subprocess.run(["scancel", "--batch", "--signal=USR1", job], check=True)),
    (32, "trainer kill", lambda job, d: os.kill(trainer_rank0(d), signal.SIGKILL)),
]


def release_hung() -> None:
    """SIGCONT a hung engine still alive HANG_S after its SIGSTOP (or at the end)."""
    for pid, since in list(HUNG):
        if time.time() - since >= HANG_S or not psutil.pid_exists(pid):
            HUNG.remove((pid, since))
            if psutil.pid_exists(pid):
                os.kill(pid, signal.SIGCONT)


def events(job_dir: Path) -> list[dict]:
    """events.jsonl's complete lines (none before the supervisor starts)."""
    path = job_dir / "events.jsonl"
    text = path.read_text() if path.exists() else ""
    return [json.loads(line) for line in text[:text.rfind("\n") + 1].splitlines()]


def final_end(ev: list[dict]) -> float | None:
    """The time the job's trainer finished for good (not before a requeue), or the job failed."""
    requeued = max((e["time"] for e in ev if e["kind"] == "requeue"), default=0.0)
    ends = [e["time"] for e in ev if e["kind"] in ("trainer_finished", "job_failed") and e["time"] > requeued]
    return ends[-1] if ends else None


def run(root: Path, name: str, model: Path, data: Path, failures: bool) -> dict:
    job_dir = root / name
    job_id = submit(job_dir, model, data, *FLAGS)
    injected: list[tuple[str, float, int]] = []  # (failure, time, rollouts done)
    lost_node = None
    try:
        for at, kind, inject in SCHEDULE if failures else []:
            def ready() -> bool:
                release_hung()
                return len(set(rollout_ids(job_dir))) >= at and all_engines_healthy(job_dir)
            wait_for(ready, FAILURE_WAIT_S, f"{at} rollouts and healthy engines", interval_s=0.05)
            if lost_node is not None:  # the engine has moved to the spare: the site mends the node
                DevCluster(DEFAULT_ROOT).revive_slurmd(lost_node)  # (a requeue needs all 4 nodes)
                lost_node = None
            if kind == "node loss":
                lost_node = engine_0(job_dir)["nodes"][0]
            injected.append((kind, time.time(), len(set(rollout_ids(job_dir)))))
            inject(job_id, job_dir)

        def finished() -> bool:
            release_hung()
            return final_end(events(job_dir)) is not None
        wait_for(finished, JOB_END_S, "the job's end", interval_s=0.2)
        return {"events": events(job_dir), "injected": injected, "job_id": job_id,
                "resumes": [int(n) for n in re.findall(r"next rollout (\d+)", (job_dir / "logs/trainer.log").read_text())]}
    finally:
        for pid, _ in HUNG:
            if psutil.pid_exists(pid):
                os.kill(pid, signal.SIGCONT)
        HUNG.clear()
        if lost_node is not None:
            DevCluster(DEFAULT_ROOT).revive_slurmd(lost_node)
        subprocess.run(["scancel", job_id], capture_output=True)
        wait_job_gone(job_id)


def figures(result: dict, gap_cap: float | None) -> dict:
    ev = result["events"]
    start = next(e["time"] for e in ev if e["kind"] == "supervisor_started")
    end = final_end(ev)
    hold = 0.0
    for e in (e for e in ev if e["kind"] == "requeue"):
        hold += next(s["time"] for s in ev if s["kind"] == "supervisor_started" and s["time"] > e["time"]) - e["time"]
    published = [(e["time"], int(e["version"])) for e in ev if e["kind"] == "weights_published"]
    # Version v is published after rollout v-1; a (re)started trainer first publishes the version
    # it resumes from (a drop, or the same version again): that one is no rollout done again.
    new_times, best, previous, redone = [], -1, None, []
    for t, version in published:
        if version > best:
            new_times.append(t)
            best = version
        elif previous is not None and version == previous + 1:
            redone.append(t)
        previous = version
    gaps = [b - a for a, b in zip(new_times, new_times[1:])]
    cap = gap_cap if gap_cap is not None else statistics.median(gaps)
    progress = sum(min(g, cap) for g in gaps)
    wall = end - start
    lost = {}
    times = [t for _, t, _ in result["injected"]] + [float("inf")]
    for (kind, t, _), nxt in zip(result["injected"], times[1:]):
        lost[kind] = sum(1 for r in redone if t <= r < nxt)
    return {"wall": wall, "hold": hold, "progress": progress, "ettr": progress / wall, "cap": cap,
            "versions": best, "redone": len(redone), "lost": lost, "resumes": result["resumes"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=None, help="default: a new temporary folder")
    root = parser.parse_args().workdir or Path(tempfile.mkdtemp(prefix="bench_goodput_"))
    model, data = write_tiny_model(root / "model"), write_toy_data(root / "toy.jsonl")
    clean = figures(run(root, "clean", model, data, failures=False), None)
    failed_run = run(root, "failures", model, data, failures=True)
    failed = figures(failed_run, clean["cap"])
    rate = (clean["versions"] / clean["wall"]) / (failed["versions"] / (failed["wall"] - failed["hold"]))
    print(f"toy job, {ROLLOUTS} rollouts, slow reward; progress gap cap {clean['cap']:.2f} s (clean run's median)")
    print(f"{'run':10s} {'wall s':>7s} {'hold s':>7s} {'progress s':>10s} {'ETTR':>6s} {'redone':>6s}")
    for name, f in (("clean", clean), ("failures", failed)):
        print(f"{name:10s} {f['wall']:7.1f} {f['hold']:7.1f} {f['progress']:10.1f} {f['ettr']:6.3f} {f['redone']:6d}")
    print(f"ETTR ratio failures/clean: {failed['ettr'] / clean['ettr']:.3f}; progress rate outside the requeue hold, "
          f"clean/failures: {1 / rate:.3f}")
    print("per failure (at rollouts done): rollouts redone")
    for kind, _, done in failed_run["injected"]:
        print(f"  {kind:13s} at {done:2d}: {failed['lost'][kind]}")
    print(f"trainer starts at rollouts: {failed['resumes']}")


if __name__ == "__main__":
    main()
