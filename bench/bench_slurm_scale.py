"""The head node's cost of engines at scale (issue 29, item 17): 512 stand-in engines on 64 emulated
nodes of a devcluster of its own, launched, probed and restarted through the supervisor's step
control, one way after the other in the same job and process:

    step   one srun step per engine (supervisor/steps.py, StepController), the fallback
    agent  one srun step per node, whose agent starts, watches and restarts that node's engines
           (supervisor/node_agents.py, NodeAgentSteps; `steps.engine_launch: node_agent`)

For each: the head node's memory (RSS, PSS and threads of the srun clients (srun forks a second
process per step, its shepherd), which run on the batch node,
and of the bench's own process, which stands for the supervisor), the time from the first launch
until every engine answers its probe (launches paced by slurm/pacing.py as the supervisor's are),
the time of one probe cycle over all engines (rollout/engine_client.py's probe_all), and the SLURM
steps used by 100 restarts (engines crashing at once, each relaunched as its exit is seen).

The engine is bench/scale_engine.c (built here with cc): it answers every request 200 and exits on
`POST /exit`, a few hundred KiB a process, so 512 fit on a shared 2-core machine.

    flock /tmp/devcluster.lock python3 bench/bench_slurm_scale.py [--nodes 64] [--engines 512] \\
        [--restarts 100] [--modes step,agent] [--dir /tmp/slurmrl-scale] [--port-base 18800]

It brings its own devcluster up at --dir (shared loopback, nodes named scale1..scaleN) and always
takes it down again; hold /tmp/devcluster.lock while it runs where others share the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psutil
import requests

from rollout.engine_client import EngineClient
from slurm.client import SlurmClient
from slurm.devcluster import DevCluster
from slurm.devcluster.config import ClusterShape
from slurm.step_spec import StepSpec
from supervisor.node_agents import AgentShape, NodeAgentSteps
from supervisor.step_control import Step, StepControl
from supervisor.steps import StepController

HOST = "127.0.0.1"  # shared loopback: every emulated node is this machine
CLUSTER_UP_S = 300.0  # for 64 slurmd to register idle
JOB_START_S = 120.0  # for the bench's job to start
RESULT_WAIT_S = 1800.0  # for the job to measure every mode
HEALTHY_WAIT_S = 600.0  # for every engine to answer after a launch, or after the restarts
PROBE_TIMEOUT_S = 10.0  # one probe
PROBE_POLL_S = 0.2  # between two probe rounds while engines start
PROBE_CYCLES = 3  # probe cycles timed; the median is reported
QUERY_S, EXIT_CODE_S = 30.0, 30.0  # squeue/sacct bounds
STOP_S, TERM_GRACE_S = 30.0, 5.0  # cancelling a step at the end of a mode
CANCEL_THREADS = 16
MIB = 1024 * 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=64)
    parser.add_argument("--engines", type=int, default=512)
    parser.add_argument("--restarts", type=int, default=100)
    parser.add_argument("--modes", default="step,agent", help="comma-separated: step, agent")
    parser.add_argument("--dir", type=Path, default=Path("/tmp/slurmrl-scale"))
    parser.add_argument("--port-base", type=int, default=18800, help="the devcluster's daemons' ports")
    parser.add_argument("--engine-port", type=int, default=31000, help="engine k listens on this + k")
    parser.add_argument("--inside", type=Path, help=argparse.SUPPRESS)  # the job's side: write results here
    args = parser.parse_args()
    modes = args.modes.split(",")
    if set(modes) - {"step", "agent"} or args.engines % args.nodes:
        parser.error("--modes takes step and agent; --engines must be a multiple of --nodes")
    if args.inside:
        measure_all(args, modes)
        return
    results = run_on_own_cluster(args)
    print(report(results, args))


# ---------------------------------------------------------------------------------------- outside
def run_on_own_cluster(args: argparse.Namespace) -> dict[str, Any]:
    work = args.dir / "bench"
    work.mkdir(parents=True, exist_ok=True)
    engine = work / "scale_engine"
    subprocess.run(["cc", "-O2", "-o", str(engine), str(Path(__file__).with_name("scale_engine.c"))], check=True)
    shape = ClusterShape(nodes=args.nodes, gpus_per_node=0, cpus_per_node=args.engines // args.nodes,
                         port_base=args.port_base, isolated=False, node_prefix="scale")
    cluster = DevCluster(args.dir, shape)
    try:
        cluster.up(timeout_s=CLUSTER_UP_S)
        return run_job(cluster, args, work)
    finally:
        cluster.down()


def run_job(cluster: DevCluster, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    out = work / "results.json"
    out.unlink(missing_ok=True)
    script = work / "job.sh"
    inner = [sys.executable, str(Path(__file__).resolve()), "--inside", str(out), "--modes", args.modes,
             "--nodes", str(args.nodes), "--engines", str(args.engines), "--restarts", str(args.restarts),
             "--dir", str(args.dir), "--engine-port", str(args.engine_port)]
    script.write_text(f"#!/bin/bash\ncd {Path.cwd()}\nexec {' '.join(inner)}\n")
    slurm = cluster.slurm
    job_id = slurm.require("sbatch", "--parsable", f"--nodes={args.nodes}", "--exclusive", "--time=60",
                           f"--output={work}/job.out", "--job-name=scale-bench", str(script)).strip()
    deadline = time.monotonic() + RESULT_WAIT_S
    while slurm.call("squeue", "-h", "-j", job_id, "-o", "%T").stdout.strip() and time.monotonic() < deadline:
        time.sleep(1.0)
    results = json.loads(out.read_text()) if out.exists() else {}
    if set(results) != set(args.modes.split(",")):
        tail = (work / "job.out").read_text()[-3000:] if (work / "job.out").exists() else ""
        raise RuntimeError(f"the bench job {job_id} measured {sorted(results) or 'nothing'} of {args.modes}:\n{tail}")
    return dict(results)


def report(results: dict[str, Any], args: argparse.Namespace) -> str:
    lines = [f"{args.engines} engines on {args.nodes} nodes, {args.restarts} restarts"]
    keys = ("srun_clients", "srun_rss_mib", "srun_pss_mib", "srun_threads", "head_rss_mib_per_engine",
            "supervisor_rss_mib", "launch_s", "probe_cycle_s", "restart_s", "steps_for_restarts")
    for key in keys:
        lines.append(f"  {key:26s}" + "".join(f"{m}={results[m][key]:<12}" for m in results))
    if {"step", "agent"} <= set(results):
        step, agent = results["step"], results["agent"]
        for key in ("head_rss_mib_per_engine", "launch_s", "probe_cycle_s", "restart_s"):
            lines.append(f"  ratio step/agent {key:26s} {step[key] / max(agent[key], 1e-9):.2f}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------- inside
def measure_all(args: argparse.Namespace, modes: list[str]) -> None:
    job_id = os.environ["SLURM_JOB_ID"]
    nodes = SlurmClient().hostnames(os.environ["SLURM_JOB_NODELIST"])
    results = {}
    for mode in modes:  # each mode's figures kept as soon as they are known
        results[mode] = measure(mode, job_id, nodes, args)
        args.inside.with_suffix(".tmp").write_text(json.dumps(results, indent=1))
        args.inside.with_suffix(".tmp").rename(args.inside)


def step_control(mode: str, job_id: str, per_node: int, engines: list[str], logs: Path,
                 on_exit: Callable[[Step], None]) -> StepControl:
    srun_steps = StepController(job_id, QUERY_S, EXIT_CODE_S, on_exit=on_exit)
    if mode == "step":
        return srun_steps
    shape = AgentShape(sys.executable, logs, cpus_per_node=per_node, gpus_per_node=0)
    return NodeAgentSteps(srun_steps, shape, engines, on_exit=on_exit)


def measure(mode: str, job_id: str, nodes: list[str], args: argparse.Namespace) -> dict[str, Any]:
    per_node = args.engines // len(nodes)
    work = args.dir / "bench"
    engine = work / "scale_engine"
    specs = {f"engine-{k}": StepSpec(f"engine-{k}", (str(engine), HOST, str(args.engine_port + k)),
                                     (nodes[k // per_node],), work / "logs" / mode / f"engine-{k}.log",
                                     cpus_per_task=1)
             for k in range(args.engines)}
    urls = {name: f"http://{HOST}:{args.engine_port + k}" for k, name in enumerate(specs)}
    inbox: queue.Queue[Step] = queue.Queue()
    control = step_control(mode, job_id, per_node, list(specs), work / "logs" / mode, inbox.put)
    client = EngineClient("bench", PROBE_TIMEOUT_S)
    own_before = psutil.Process().memory_info().rss
    steps: dict[str, Step] = {}
    try:
        began = time.monotonic()
        for name, spec in specs.items():
            steps[name] = control.launch(spec)
        wait_healthy(client, urls)
        launch_s = time.monotonic() - began
        sruns = psutil.Process().children(recursive=True)
        srun_rss = sum(_rss(p) for p in sruns)
        srun_pss = sum(_pss(p) for p in sruns)  # shared pages (libslurm, libc) split among the sharers
        own_rss = psutil.Process().memory_info().rss - own_before
        cycles = []
        for _ in range(PROBE_CYCLES):
            began = time.monotonic()
            assert all(r.ok for r in client.probe_all(urls).values())
            cycles.append(time.monotonic() - began)
        restart_s, steps_used = restart(control, specs, steps, urls, client, inbox, args.restarts)
        return {"srun_clients": len(sruns), "srun_rss_mib": round(srun_rss / MIB, 1),
                "srun_pss_mib": round(srun_pss / MIB, 1),
                "srun_threads": sum(_threads(p) for p in sruns),
                "supervisor_rss_mib": round(own_rss / MIB, 1),
                "head_rss_mib_per_engine": round((srun_rss + own_rss) / MIB / len(specs), 3),
                "launch_s": round(launch_s, 2), "probe_cycle_s": round(statistics.median(cycles), 3),
                "restart_s": round(restart_s, 2), "steps_for_restarts": steps_used}
    finally:
        control.refresh(list(steps.values()))  # their step ids, for scancel
        with ThreadPoolExecutor(CANCEL_THREADS) as pool:
            list(pool.map(lambda s: control.cancel(s, STOP_S, TERM_GRACE_S),
                          [s for s in steps.values() if s.returncode is None]))
        control.close()
        client.close()


def restart(control: StepControl, specs: dict[str, StepSpec], steps: dict[str, Step], urls: dict[str, str],
            client: EngineClient, inbox: queue.Queue[Step], count: int) -> tuple[float, int]:
    """`count` engines crash at once; each is relaunched as its exit is seen, as the supervisor's
    recovery does. (seconds until all answer again, SLURM steps launched meanwhile)"""
    victims = list(specs)[:: max(1, len(specs) // count)][:count]
    steps_before = control.count().launched
    began = time.monotonic()
    for name in victims:
        try:
            requests.post(f"{urls[name]}/exit", timeout=PROBE_TIMEOUT_S)
        except requests.RequestException:  # it may close before the answer is read
            pass
    pending = set(victims)
    deadline = time.monotonic() + HEALTHY_WAIT_S
    while pending:
        step = inbox.get(timeout=max(0.0, deadline - time.monotonic()))
        if step.spec_name in pending and steps[step.spec_name] is step:
            pending.discard(step.spec_name)
            steps[step.spec_name] = control.launch(specs[step.spec_name])
    wait_healthy(client, {name: urls[name] for name in victims})
    return time.monotonic() - began, control.count().launched - steps_before


def wait_healthy(client: EngineClient, urls: dict[str, str]) -> None:
    waiting = dict(urls)
    deadline = time.monotonic() + HEALTHY_WAIT_S
    while waiting:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(waiting)} engines did not answer within {HEALTHY_WAIT_S:.0f} s")
        results = client.probe_all(waiting)
        waiting = {name: url for name, url in waiting.items() if not results[name].ok}
        if waiting:
            time.sleep(PROBE_POLL_S)


def _rss(proc: psutil.Process) -> int:
    try:
        return int(proc.memory_info().rss)
    except psutil.Error:
        return 0


def _pss(proc: psutil.Process) -> int:
    try:
        return int(proc.memory_full_info().pss)
    except psutil.Error:
        return 0


def _threads(proc: psutil.Process) -> int:
    try:
        return int(proc.num_threads())
    except psutil.Error:
        return 0


if __name__ == "__main__":
    main()
