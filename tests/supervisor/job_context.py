"""An in-process JobContext of two CPU-engine places on 127.0.0.1 (nothing listens on their ports:
a connection is refused), for the supervisor's recovery tests."""

from __future__ import annotations

import queue
import threading
from pathlib import Path

from contract.job_dir import JobDir
from contract.spec import FaultToleranceSpec, JobSpec, RolloutSpec
from rollout.engine_client import EngineClient
from rollout.router_client import RouterClient
from supervisor.context import JobContext
from supervisor.engine_states import HEALTHY
from supervisor.engines import Engines
from supervisor.events import EventLog
from supervisor.launcher import RouterPlace
from supervisor.layout import EnginePlace, Layout
from supervisor.state import StateStore, StepRecord
from tests.ports import free_port


def two_engine_job(spec: JobSpec, head: str, node: str, het_group: int) -> tuple[JobContext, RouterPlace]:
    """Engines engine-0 and engine-1 on `node` (hetjob component `het_group`), healthy and recorded
    in the job's state; the router's place, where nothing listens."""
    job_dir = JobDir(Path(spec.job_dir))
    places = [EnginePlace(f"engine-{k}", k, (node,), "127.0.0.1", free_port(), het_group, 0) for k in range(2)]
    layout = Layout(job_id="999999", head=head, head_address="127.0.0.1", trainer_nodes=(head,),
                    rollout_nodes=(node,), router_port=0, router_metrics_port=0, trainer_master_port=0,
                    engines=tuple(places))
    client = EngineClient("key", spec.fault_tolerance.rollout_health_check_timeout)
    router = RouterPlace(f"http://127.0.0.1:{free_port()}", 0, 0)
    store = StateStore(job_dir)
    with store.update() as state:
        for place in places:
            state.steps[place.name] = StepRecord(place.name, "engine", het_group, list(place.nodes), url=place.url)
    engines = Engines(places, RouterClient(router.url, "key", 5.0), client, "key", listed_timeout_s=5.0, store=store)
    for engine in engines.values():
        engine.state = HEALTHY  # the test's start: no transition of the job's own
    job = JobContext(spec=spec, dir=job_dir, layout=layout, events=EventLog(job_dir.events), store=store,
                     engines=engines, client=client, finished=threading.Event(), inbox=queue.Queue())
    return job, router


def unplaced_job(job_dir: Path) -> tuple[JobContext, RouterPlace]:
    """Two engines on a node SLURM does not know, that may not restart (max_engine_restarts 0): a
    recovery asks SLURM (squeue, scancel; answered within 5 s) and then gives the engine up."""
    ft = FaultToleranceSpec(use_fault_tolerance=True, max_engine_restarts=0, min_engines=0,
                            slurm_command_timeout=5.0, rollout_health_check_timeout=2.0)
    spec = JobSpec(job_dir=str(job_dir), rollout=RolloutSpec(engine="cpu", num_engines=2), fault_tolerance=ft)
    return two_engine_job(spec, head="no-such-head", node="no-such-node", het_group=1)
