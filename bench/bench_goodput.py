"""Goodput on the devcluster: the toy job under a failure schedule against the same job without
failures, both run by this process (issue 17 item 5).

The toy job runs with a slow reward model (about 1.4 s a rollout: bench_resume's pace),
--num-rollout rollouts (40 by default), --save-interval 5 and a spare rollout node. One run has no
failure; the other gets five, spread over the run (one per num_rollout/5 rollouts), each once
that fraction of the rollouts is done and every engine is healthy again (at 40: 6, 12, 18, 25, 32):

    0.15  engine kill:   SIGKILL engine-0's server
    0.30  engine hang:   SIGSTOP engine-1's server (its probes time out; the supervisor replaces it;
                         SIGCONT after HANG_S if it is still there)
    0.45  node loss:     engine-0's node (its slurmd and the engine's step) dies; spare node
                         (the node's slurmd is started again once the engine has moved:
                         the requeue below needs all 4 devcluster nodes)
    0.625 preemption:    SLURM's warning signal (scancel --batch --signal=USR1): save, requeue
    0.80  trainer kill:  SIGKILL trainer rank 0: in-job restart from the latest checkpoint

From events.jsonl (weights_published, one per rollout: a version above every earlier one is new
progress) and trainer.log ("next rollout N" at each trainer start, "replayed from the rollout
journal" for a rollout trained on again without generating it):
- wall: first supervisor start to the trainer's finish; requeue hold: from the supervisor's
  `requeue` event to the requeued job's supervisor start (SLURM's own hold), reported apart.
- pace: the failure-free run's median gap between new versions (seconds a rollout).
- progress time: the time between consecutive new versions, each capped at the pace (anything
  above it is time lost); ETTR = progress time / wall.
- rate ratio: the failure-free run's progress per second over this run's outside the hold (the
  same rollouts: its wall over this one's less the hold); also with both runs' starts left out
  (the start, before the first failure, varies with the machine's load and is no failure's).
- seconds lost per failure: from it to the next one (the last: to the job's end, less the
  failure-free run's own end), that window's time less its new versions at the pace, less the
  requeue hold in it: stalls and rollouts done again together. Rollouts done again: versions
  published a second time (not a resumed trainer's first publish), of which replayed: trained
  on again from the rollout journal, not generated again.

    PYTHONPATH=. python -m bench.bench_goodput [--workdir DIR] [--num-rollout N]  # devcluster up; as root
    PYTHONPATH=. python -m bench.bench_goodput --workdir DIR --report-only       # the figures again
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

ROLLOUTS = 40  # --num-rollout's default
FLAGS = ("--rollout-spare-nodes", "1")
HANG_S = 60  # a hung engine the supervisor has not replaced by then is let go on (SIGCONT)
FAILURE_WAIT_S = 300  # bound for each failure's trigger, and for the job's end after the last one
JOB_END_S = 600
SETTINGS = "bench.json"  # in --workdir: the runs' --num-rollout, for --report-only
INJECTED = "injected.json"  # in a run's job dir: [failure, time, rollouts done] of each failure


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
# Each failure once this fraction of --num-rollout is done (40 rollouts: 6, 12, 18, 25, 32).
SCHEDULE: list[tuple[float, str, Callable[[str, Path], None]]] = [
    (0.15, "engine kill", lambda job, d: os.kill(listening_pid(engine_0(d)["url"]), signal.SIGKILL)),
    (0.30, "engine hang", hang_engine_1),
    (0.45, "node loss", lambda job, d: kill_engine_0_node(d)),
    (0.625, "preemption", lambda job, d: subprocess.run(["scancel", "--batch", "--signal=USR1", job], check=True)),
    (0.80, "trainer kill", lambda job, d: os.kill(trainer_rank0(d), signal.SIGKILL)),
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


def supervisor_starts(job_dir: Path) -> int:
    return sum(e["kind"] == "supervisor_started" for e in events(job_dir))


def final_end(ev: list[dict]) -> float | None:
    """The time the job's trainer finished for good (not before a requeue), or the job failed."""
    requeued = max((e["time"] for e in ev if e["kind"] == "requeue"), default=0.0)
    ends = [e["time"] for e in ev if e["kind"] in ("trainer_finished", "job_failed") and e["time"] > requeued]
    return ends[-1] if ends else None


def run(root: Path, name: str, model: Path, data: Path, rollouts: int, failures: bool) -> dict:
    job_dir = root / name
    job_id = submit(job_dir, model, data, "--num-rollout", str(rollouts), *FLAGS)
    injected: list[tuple[str, float, int]] = []  # (failure, time, rollouts done)
    lost_node = None
    try:
        for fraction, kind, inject in SCHEDULE if failures else []:
            at = round(fraction * rollouts)
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
            starts = supervisor_starts(job_dir)
            inject(job_id, job_dir)
            if kind == "preemption":  # the next failure waits for the requeued job (the preempted
                # trainer still finishes its rollout in flight and saves: a kill then hits that save)
                wait_for(lambda: supervisor_starts(job_dir) > starts, FAILURE_WAIT_S, "the requeued job's start",
                         interval_s=0.05)

        def finished() -> bool:
            release_hung()
            return final_end(events(job_dir)) is not None
        wait_for(finished, JOB_END_S, "the job's end", interval_s=0.2)
        (job_dir / INJECTED).write_text(json.dumps(injected))
        return read_run(job_dir)
    finally:
        for pid, _ in HUNG:
            if psutil.pid_exists(pid):
                os.kill(pid, signal.SIGCONT)
        HUNG.clear()
        if lost_node is not None:
            DevCluster(DEFAULT_ROOT).revive_slurmd(lost_node)
        subprocess.run(["scancel", job_id], capture_output=True)
        wait_job_gone(job_id)


def read_run(job_dir: Path) -> dict:
    """A finished run's record: its events, its failures (INJECTED), its trainer starts."""
    injected = job_dir / INJECTED
    log = (job_dir / "logs/trainer.log").read_text()
    replayed = [time.mktime(time.strptime(stamp, "%Y-%m-%d %H:%M:%S")) + int(ms) / 1000  # logging's local asctime
                for stamp, ms in re.findall(r"^(\S+ \S+),(\d+) \S+ INFO rollout \d+: replayed from the rollout journal",
                                            log, re.MULTILINE)]
    return {"events": events(job_dir), "injected": json.loads(injected.read_text()) if injected.exists() else [],
            "resumes": [int(n) for n in re.findall(r"next rollout (\d+)", log)], "replayed": replayed}


def figures(result: dict, pace: float | None, end_overhead: float | None = None) -> dict:
    """The run's figures; `pace`: seconds per new version of the failure-free run (its median gap),
    None for that run itself; `end_overhead`: that run's seconds from its last new version to its
    end (the job's final save and exit), not counted against the last failure."""
    ev = result["events"]
    start = next(e["time"] for e in ev if e["kind"] == "supervisor_started")
    end = final_end(ev)
    holds = []  # (requeue, the requeued job's supervisor start)
    for e in (e for e in ev if e["kind"] == "requeue"):
        holds.append((e["time"], next(s["time"] for s in ev if s["kind"] == "supervisor_started" and s["time"] > e["time"])))
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
    pace = pace if pace is not None else statistics.median(gaps)
    progress = sum(min(g, pace) for g in gaps)
    wall = end - start
    # Seconds lost per failure: from its injection to the next one's (the last: to the job's end),
    # the time not spent at the failure-free pace on new versions (stalls and rollouts redone),
    # less SLURM's requeue hold inside it; before the first failure: the start.
    bounds = [start] + [t for _, t, _ in result["injected"]] + [end]
    windows = []
    for a, b in zip(bounds, bounds[1:]):
        made = sum(1 for t in new_times if a < t <= b)
        hold = sum(min(b, h1) - max(a, h0) for h0, h1 in holds if h0 < b and h1 > a)
        windows.append({"seconds": b - a, "hold": hold, "new": made, "lost": b - a - hold - made * pace,
                        "redone": sum(1 for r in redone if a <= r < b),
                        "replayed": sum(1 for r in result["replayed"] if a <= r < b)})
    windows[-1]["lost"] -= end_overhead if end_overhead is not None else 0.0
    return {"wall": wall, "hold": sum(h1 - h0 for h0, h1 in holds), "progress": progress,
            "ettr": progress / wall, "pace": pace, "versions": best, "redone": len(redone),
            "replayed": len(result["replayed"]),
            "windows": windows, "resumes": result["resumes"], "end_overhead": end - new_times[-1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=None, help="default: a new temporary folder")
    parser.add_argument("--num-rollout", type=int, default=ROLLOUTS,
                        help="rollouts of each run; the failures are spread over it (one per num_rollout/5)")
    parser.add_argument("--report-only", action="store_true", help="the figures of the runs already in --workdir")
    options = parser.parse_args()
    if options.report_only and options.workdir is None:
        parser.error("--report-only reads the runs in --workdir: give it")
    rollouts = options.num_rollout
    if rollouts < 2 * len(SCHEDULE):
        parser.error(f"--num-rollout {rollouts}: at least {2 * len(SCHEDULE)} (the failures need rollouts between them)")
    root = options.workdir or Path(tempfile.mkdtemp(prefix="bench_goodput_"))
    if options.report_only:
        clean_run, failed_run = read_run(root / "clean"), read_run(root / "failures")
        if (root / SETTINGS).exists():
            rollouts = json.loads((root / SETTINGS).read_text())["num_rollout"]
    else:
        model, data = write_tiny_model(root / "model"), write_toy_data(root / "toy.jsonl")
        (root / SETTINGS).write_text(json.dumps({"num_rollout": rollouts}))
        clean_run = run(root, "clean", model, data, rollouts, failures=False)
        failed_run = run(root, "failures", model, data, rollouts, failures=True)
    clean = figures(clean_run, None)
    failed = figures(failed_run, clean["pace"], clean["end_overhead"])
    outside = failed["wall"] - failed["hold"]
    ratio = clean["wall"] / outside  # the same versions made: progress rates outside the hold
    print(f"toy job, {rollouts} rollouts, slow reward, {len(SCHEDULE)} failures: one per {rollouts / len(SCHEDULE):.0f} "
          f"rollouts; pace {clean['pace']:.2f} s a rollout (the clean run's median gap between new versions)")
    print(f"{'run':10s} {'wall s':>7s} {'hold s':>7s} {'progress s':>10s} {'ETTR':>6s} {'redone':>6s} {'replayed':>8s}")
    for name, f in (("clean", clean), ("failures", failed)):
        print(f"{name:10s} {f['wall']:7.1f} {f['hold']:7.1f} {f['progress']:10.1f} {f['ettr']:6.3f} {f['redone']:6d} "
              f"{f['replayed']:8d}")
    print(f"ETTR ratio failures/clean: {failed['ettr'] / clean['ettr']:.3f}; progress rate outside the requeue hold, "
          f"failures/clean: {ratio:.3f} (target 0.97)")
    print("per failure: seconds from it to the next one, new rollouts made, rollouts redone, seconds lost "
          "(the window less its new rollouts at the clean pace, less the requeue hold)")
    clean_start = clean["windows"][0]
    print(f"  {'start':13s} (clean run: {clean_start['lost']:.1f} s lost before its pace)")
    rows = [("start", None), *((kind, done) for kind, _, done in failed_run["injected"])]
    for (kind, done), w in zip(rows, failed["windows"]):
        at = f"at {done:3d}" if done is not None else "      "
        hold = f", hold {w['hold']:.1f} s apart" if w["hold"] else ""
        print(f"  {kind:13s} {at}: {w['seconds']:6.1f} s, {w['new']:3d} new, {w['redone']} redone "
              f"({w['replayed']} replayed), lost {w['lost']:5.1f} s{hold}")
    print(f"  (the last window holds the job's end, less the clean run's {clean['end_overhead']:.1f} s from its "
          "last version to its end)")
    lost = [w["lost"] for w in failed["windows"][1:]]
    mean, pace, n = statistics.mean(lost), clean["pace"], rollouts / len(SCHEDULE)
    print(f"mean lost per failure {mean:.1f} s = {mean / pace:.1f} rollouts at the clean pace: at one failure per N "
          f"rollouts the rate ratio is N*{pace:.2f}/(N*{pace:.2f}+{mean:.1f}): {n * pace / (n * pace + mean):.3f} at "
          f"this run's N = {n:.0f} (the starts, which vary with the machine's load, left out); "
          f">= 0.97 from N = {0.97 * mean / (0.03 * pace):.0f}")
    print(f"trainer starts at rollouts: {failed['resumes']}")


if __name__ == "__main__":
    main()
