"""The kill cap (invariant 5) after each probe cycle, said aloud: of the engines whose probe
failures reached the threshold, those the cap allows are recovered; the others run on, held back,
and say so once (an engine_held_back event with the cap, `unhealthy` with the reason in their
record and `slurmrl status`) until their probe passes again (engine_hold_released) or the cap lets
them be recovered."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from rollout.engine_client import ProbeResult
from supervisor.context import JobContext
from supervisor.engine_record import Engine
from supervisor.probe import KillBudget


def act_on_probes(job: JobContext, recover: Callable[[Engine, str], object], results: Mapping[str, ProbeResult],
                  failed: Sequence[str], budget: KillBudget) -> None:
    """results: the cycle's probes; failed: the engines past the threshold (HealthTracker.record);
    recover: EngineRecovery.recover."""
    total = len(job.engines)
    allowed = budget.allow(failed, dead=set(), total_engines=total)
    threshold = job.ft.health_check_failure_threshold
    for name in failed:
        why = f"/health_generate failed {threshold} times in a row ({results[name].error})"
        if name in allowed:
            recover(job.engines[name], why)
        elif job.engines.hold_back(job.engines[name], why):
            job.events.emit("engine_held_back", name, reason=why, kill_cap=budget.cap(total),
                            interval_s=budget.interval_s)
    for engine in job.engines.release_holds(name for name, result in results.items() if result.ok):
        job.events.emit("engine_hold_released", engine.name, reason="its /health_generate passes again")
