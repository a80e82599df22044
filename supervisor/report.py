"""`slurmrl report JOB`: PNG plots of a job from its own files, written to JOB_DIR/report/:

- reward.png: the mean reward and each eval set's score per rollout (metrics.jsonl);
- phases.png: each rollout's time split by phase, stacked (contract.PHASE_TIMES; derived from
  the loop's seconds for lines written before those names existed);
- events.png: the supervisor's failures and recoveries (events.jsonl) on the job's time axis, one
  row per step, with each published weight version marked.

Works on a running or a finished job (it only reads). matplotlib's Agg backend: no display needed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from contract.job_dir import PHASE_TIMES, JobDir, phase_times
from contract.spec import FaultToleranceSpec
from supervisor import slurm_jobs

REWARD, PHASES, EVENTS = "reward.png", "phases.png", "events.png"
# events.jsonl kinds drawn on events.png: what went wrong, and what the supervisor did about it
FAILURES = ("engine_failed", "engine_start_failed", "engine_restart_failed", "engine_given_up", "engine_degraded",
            "engine_held_back", "no_engine_serving", "engines_stranded", "save_now_unanswered", "router_failed",
            "trainer_failed", "trainer_hung", "node_failed", "trainer_node_lost", "exclude_failed", "job_failed")
RECOVERIES = ("engine_recovered", "engine_hold_released", "engine_moved", "router_relaunched", "trainer_restarted",
              "step_adopted")
INTERRUPTIONS = ("preemption", "requeue", "save_now", "job_ending", "stop_requested", "time_limit_changed",
                 "no_time_to_save", "trainer_stopped", "trainer_abandoned")
_WAITS = FaultToleranceSpec()


class ReportError(ValueError):
    """The job dir holds nothing to plot, or a file in it does not parse."""


def read_lines(path: Path) -> list[dict[str, Any]]:
    """A JSON-lines file's objects ([] when it does not exist); ReportError naming file:line."""
    if not path.is_file():
        return []
    lines = []
    for number, text in enumerate(path.read_text().splitlines(), 1):
        if not text.strip():
            continue
        try:
            line = json.loads(text)
        except ValueError as err:
            raise ReportError(f"{path}:{number} is not JSON ({err})") from None
        if not isinstance(line, dict):
            raise ReportError(f"{path}:{number} is not a JSON object")
        lines.append(line)
    return lines


def write_report(job_dir: JobDir) -> list[Path]:
    """The PNGs of the job (those its files have data for), in JOB_DIR/report/."""
    if not job_dir.root.is_dir():
        raise ReportError(f"{job_dir.root} is not a directory")
    metrics, events = read_lines(job_dir.metrics), read_lines(job_dir.events)
    if not metrics and not events:
        raise ReportError(f"{job_dir.root} has no metrics.jsonl or events.jsonl lines: not a slurmrl job dir, "
                          "or its job has not started")
    import matplotlib

    matplotlib.use("Agg")
    out = job_dir.root / "report"
    out.mkdir(exist_ok=True)
    written = []
    if metrics:
        written += [_reward(metrics, out / REWARD), _phases(metrics, out / PHASES)]
    if events:
        written.append(_events(events, out / EVENTS))
    return written


def _main_eval_keys(line_keys: set[str]) -> list[str]:
    """eval/SET, not its derived eval/SET-pass@k, eval/SET-truncated_ratio, ..."""
    evals = {k for k in line_keys if k.startswith("eval/")}
    return sorted(k for k in evals if not any(k.startswith(other + "-") for other in evals if other != k))


def _reward(metrics: list[dict[str, Any]], path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    rows = [m for m in metrics if "reward_mean" in m]
    ax.plot([m["rollout_id"] for m in rows], [m["reward_mean"] for m in rows], marker=".", label="reward_mean")
    for key in _main_eval_keys({k for m in metrics for k in m}):
        scored = [m for m in metrics if key in m]
        ax.plot([m["rollout_id"] for m in scored], [m[key] for m in scored], marker="o", label=key)
    ax.set(xlabel="rollout", ylabel="reward", title="reward and eval per rollout")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    return _save(fig, path)


def _phases(metrics: list[dict[str, Any]], path: Path) -> Path:
    import matplotlib.pyplot as plt

    ids = [m["rollout_id"] for m in metrics]
    times = [{**phase_times(m), **{k: m[k] for k in PHASE_TIMES.values() if k in m}} for m in metrics]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    bottom = [0.0] * len(ids)
    for phase, key in PHASE_TIMES.items():
        heights = [float(t[key]) for t in times]
        if not any(heights):
            continue  # a phase that never ran (no eval, no save) gets no legend entry
        ax.bar(ids, heights, bottom=bottom, label=phase, width=0.8)
        bottom = [b + h for b, h in zip(bottom, heights)]
    ax.set(xlabel="rollout", ylabel="seconds", title="time per rollout, by phase")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    return _save(fig, path)


def _events(events: list[dict[str, Any]], path: Path) -> Path:
    import matplotlib.pyplot as plt

    start = min(float(e["time"]) for e in events)
    drawn = [e for e in events if e.get("kind") in FAILURES + RECOVERIES + INTERRUPTIONS]
    rows = sorted({e.get("step") or "job" for e in drawn}) or ["job"]
    fig, ax = plt.subplots(figsize=(10, 1.5 + 0.45 * len(rows)))
    for kinds, (marker, color, size), label in ((FAILURES, ("x", "tab:red", 70), "failure"),
                                                (RECOVERIES, ("o", "tab:green", 45), "recovery"),
                                                (INTERRUPTIONS, ("s", "tab:orange", 45), "preemption/requeue/stop")):
        hits = [e for e in drawn if e["kind"] in kinds]
        if not hits:
            continue
        ax.scatter([(float(e["time"]) - start) / 60 for e in hits], [rows.index(e.get("step") or "job") for e in hits],
                   label=f"{label} ({len(hits)})", zorder=3, marker=marker, color=color, s=size)
    for e in events:
        if e.get("kind") == "weights_published":  # the rollout boundaries, on the same axis
            ax.axvline((float(e["time"]) - start) / 60, color="0.85", lw=0.8, zorder=1)
    ax.set_yticks(range(len(rows)), rows)
    ax.set_ylim(-0.7, len(rows) - 0.3)
    ax.set(xlabel="minutes since the first event (grey: a weight version published)",
           title="failures and recoveries (events.jsonl)")
    if drawn:
        ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    else:
        ax.text(0.5, 0.5, "no failure, recovery or interruption", transform=ax.transAxes, ha="center")
    return _save(fig, path)


def _save(fig: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def run(args: argparse.Namespace) -> int:
    try:
        job_dir = slurm_jobs.job_dir_of(args.job, _WAITS.slurm_command_timeout)
        written = write_report(job_dir)
    except (slurm_jobs.JobNotFound, slurm_jobs.SlurmUnavailable, ReportError, OSError) as err:
        print(f"slurmrl report: error: {err}", file=sys.stderr)
        return 1
    for path in written:
        print(path)
    return 0


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("report", help="plot a job's reward, eval, time per phase and failures "
                                   "(PNGs in JOB_DIR/report/; prints their paths)")
    parser.add_argument("job", help="SLURM job id or job directory")
    parser.set_defaults(func=run)
