"""`slurmrl status` for a person: the header and the table of steps, with the trainer's phase from
its heartbeat, step ids as sacct names them, and `-` for whatever is not known (yet)."""

from __future__ import annotations

import time
from typing import Any

from contract.job_dir import Heartbeat, Phase

_PHASE_WORDS = {Phase.START: "starting", Phase.TRAIN: "training", Phase.PUBLISH: "publishing", Phase.SAVE: "saving"}
_LIVE = ("starting", "waiting", "healthy", "unhealthy")  # states in which a probe or beat is current


def header(state: dict[str, Any]) -> str:
    return (f"job {state['job_id'] or '-'}  weight version {_known(state['weight_version'])}  "
            f"requeues {state['requeues']}  time left {_known(state.get('time_left'))}  "
            f"last checkpoint {_known(state['last_checkpoint'])}  steps {step_budget(state)}")


def step_budget(state: dict[str, Any]) -> str:
    """The job's SLURM steps launched, of MaxStepCount ("12/40000"; "12" while the limit is unknown)."""
    launched, limit = state.get("steps_launched", 0), state.get("max_step_count")
    return f"{launched}/{limit}" if limit else str(launched)


def table(steps: dict[str, dict[str, Any]], job_id: str | None, beat: Heartbeat | None,
          now: float | None = None) -> str:
    """beat: the trainer's last heartbeat from its current launch (None: none yet)."""
    now = time.time() if now is None else now
    het = any(s["het_group"] > 0 for s in steps.values())
    head = ("STEP", "KIND", "NODE", "STATE", "RESTARTS", "VERSION", "PROBE", "SEEN", "SLURM STEP")
    rows = [head]
    for name, s in sorted(steps.items()):
        live = s["state"] in _LIVE
        state, seen = s["state"], s.get("last_probe_time")
        if s["kind"] == "trainer" and live and beat is not None:
            state, seen = phase_word(beat), beat.time
        probe = s["last_probe_latency_s"]
        rows.append((name, s["kind"], ",".join(s["nodes"]), state, str(s["restarts"]), _known(s["weight_version"]),
                     f"{probe * 1000:.0f} ms" if live and probe is not None else "-",
                     f"{now - seen:.0f} s ago" if live and seen is not None else "-",
                     sacct_step(s["slurm_step"], job_id, het)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)


def ended_with_the_job(steps: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The steps of a job SLURM ended without its supervisor's word: none of them runs any more,
    whatever their last record said."""
    return {name: {**s, "state": "ended"} if s["state"] in _LIVE else s for name, s in steps.items()}


def phase_word(beat: Heartbeat) -> str:
    if beat.phase is Phase.ROLLOUT:
        return f"rollout {beat.rollout_id}" if beat.rollout_id is not None else "rollout"
    return _PHASE_WORDS[beat.phase]


def sacct_step(step_id: str | None, leader: str | None, het: bool) -> str:
    """squeue's "4.1" (a heterogeneous job's component 4 = leader 3 + 1) as sacct says it: "3+1.1"."""
    if not step_id:
        return "-"
    job, _, step = step_id.partition(".")
    if not het or not leader or not job.isdigit() or not leader.isdigit():
        return step_id
    return f"{leader}+{int(job) - int(leader)}.{step}"


def _known(value: object) -> str:
    return "-" if value is None or value == "" else str(value)
