"""Launching the job's steps (router, engines, trainer) and knowing which step is each one's
current: the launcher owns that table, under its lock."""

from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass

from contract import engine_groups
from contract.job_dir import JOB_DIR_ENV
from contract.spec import JobSpec
from contract.step_options import srun_options, with_setup
from rollout.launch import (
    EngineLaunch,
    RouterLaunch,
    cpu_engine_command,
    passthrough,
    router_command,
    sglang_command,
)
from slurm import env as slurm_env
from slurm.step_spec import StepSpec
from supervisor import layout as layouts
from supervisor import node_rank
from supervisor.context import JobContext
from supervisor.engine_record import Engine
from supervisor.engine_states import HEALTHY, STARTING
from supervisor.keys import step_env
from supervisor.layout import EnginePlace, Layout
from supervisor.node_agents import AgentShape
from supervisor.state import JobState, StepRecord
from supervisor.step_control import Step, StepControl

ROUTER, TRAINER = "router", "trainer"
_ROUTER_POLL_S = 0.2  # between two checks that a starting router answers


class JobFailed(RuntimeError):
    """The job cannot go on; the message is the reason `slurmrl status` shows."""


class StepLauncher:
    def __init__(self, job: JobContext, steps: StepControl, key: str, router: RouterPlace) -> None:
        self.job = job
        self.steps = steps
        self.router = router
        self.python = job.spec.python or sys.executable
        self.env = steps_env(job, key)
        self._lock = threading.Lock()
        self._running: dict[str, Step] = {}
        self._told_step_budget = False  # step_budget_low is said once per supervisor

    # ------------------------------------------------------------------ the table of current steps
    def current(self, name: str) -> Step | None:
        with self._lock:
            return self._running.get(name)

    def all(self) -> dict[str, Step]:
        with self._lock:
            return dict(self._running)

    def set_current(self, step: Step) -> None:
        with self._lock:
            self._running[step.spec_name] = step

    # ------------------------------------------------------------------ launching
    def launch(self, name: str, kind: str, argv: list[str], nodes: tuple[str, ...], het_group: int, *,
               ntasks: int = 1, gpus_per_node: int = 0, cpus_per_task: int | None = None,
               overlap: bool = False, env: dict[str, str] | None = None) -> Step:
        job, site = self.job, self.job.spec.steps
        spec = StepSpec(name=name, argv=tuple(with_setup(site.setup_lines(kind), argv)), nodes=nodes,
                        log=job.dir.log(name), options=tuple(srun_options(site, kind)),
                        het_group=het_group if job.spec.het_groups > 1 else None, ntasks=ntasks,
                        gpus_per_node=gpus_per_node, cpus_per_task=cpus_per_task, overlap=overlap,
                        env={**self.env, **(env or {})},
                        # where the job was submitted from: relative paths and plug-ins resolve there
                        workdir=slurm_env.submit_dir())
        step = self.steps.launch(spec)
        self.set_current(step)
        count = self.steps.count()
        with job.store.update() as state:
            record = state.steps.get(name) or StepRecord(name, kind, het_group, list(nodes))
            record.slurm_step, record.launched_at = None, time.time()
            if kind != "engine":  # an engine's state and nodes are its owner's to record (Engines)
                record.state = STARTING.value
                record.nodes = list(nodes)  # after a requeue, not the old ones
            state.steps[name] = record
            state.steps_launched, state.max_step_count = count.launched, count.limit
        job.events.emit("step_launched", name, step_kind=kind, nodes=list(nodes))
        if count.nearing and not self._told_step_budget:
            self._told_step_budget = True
            job.events.emit("step_budget_low", name, steps_launched=count.launched, max_step_count=count.limit,
                            hint="SLURM refuses srun past MaxStepCount; a requeue counts from 0 again")
        return step

    def python_of(self, role: str) -> str:
        """The interpreter of a role's steps: the image's own (steps.container_python) in a container."""
        site = self.job.spec.steps
        return site.container_python if site.image(role) else self.python

    def launch_router(self) -> None:
        """The router, on the head node; returns once it answers (JobFailed if it does not)."""
        self.await_router(self.start_router())

    def start_router(self) -> Step:
        """The router's step, launched; await_router waits until it answers (the job's first start
        launches the engines and the trainer in between)."""
        job = self.job
        launch = RouterLaunch(job.layout.head_address, self.router.port, self.router.metrics_port,
                              policy="round_robin", pd_disaggregation=engine_groups.is_pd(job.spec),
                              router_args=passthrough(job.spec.rollout.router_args, "router"))
        # --overlap: the router shares the head node's CPUs with the trainer's tasks.
        return self.launch(ROUTER, "router", _with_key(router_command(launch, self.python_of(ROUTER))),
                           (job.layout.head,), 0, overlap=True)

    def await_router(self, step: Step) -> None:
        job = self.job
        deadline = time.monotonic() + job.ft.router_start_timeout
        while not job.engines.router.alive():
            if step.returncode is not None or time.monotonic() > deadline:
                raise JobFailed(f"the router did not start within router_start_timeout "
                                f"{job.ft.router_start_timeout:.0f} s (see {job.dir.log(ROUTER)})")
            if job.finished.wait(_ROUTER_POLL_S):
                raise JobFailed("the supervisor is shutting down")
        job.store.update_step(ROUTER, state=HEALTHY.value, url=self.router.url)

    def launch_engine(self, engine: Engine) -> Step:
        """Its step (the caller tells the engines' owner: Engines.launched)."""
        place, r = engine.place, self.job.spec.rollout
        argv, env = engine_command(self.job.spec, place, self.python_of("engine")), None
        if len(place.nodes) > 1:  # one task per node, each with its node rank (supervisor/node_rank.py)
            argv = node_rank.wrapped(argv)
            env = node_rank.step_env(place.nodes, tuple(self.job.layout.addresses[n] for n in place.nodes))
        # --colocate: the step shares the trainer's CPUs and GPUs (--overlap) and sees every GPU of
        # the node the trainer sees; the engine takes its slice of them with --base-gpu-id. Stand-in
        # engines sharing GPUs share them the same way, among themselves.
        colocated = r.colocate and place.gpus_per_node
        gpus = self.job.spec.trainer.actor_num_gpus_per_node if colocated else place.gpus_per_node
        return self.launch(engine.name, "engine", _with_key(argv), place.nodes, place.het_group,
                           ntasks=len(place.nodes), gpus_per_node=gpus, cpus_per_task=r.cpus_per_engine, env=env,
                           overlap=r.colocate or r.engines_share_gpus)

    def launch_trainer(self) -> Step:
        t, layout = self.job.spec.trainer, self.job.layout
        spec, r = self.job.spec, self.job.spec.rollout
        argv = [self.python_of(TRAINER), "-m", "trainer", *t.train_args,
                "--job-dir", str(self.job.dir.root), "--supervised",
                "--master-port", str(layouts.port_free_here(layout.head_address, layout.trainer_master_port))]
        if spec.starts_engines:  # (--debug-train-only: no router, and no engine memory to release)
            host, port = self.router.url.split("//")[1].rsplit(":", 1)
            argv += ["--sglang-router-ip", host, "--sglang-router-port", port]
            argv += ["--offload-rollout"] * r.offloads_rollout
        argv += ["--offload-train"] * r.offloads_train
        # The master by address: a node's name need not resolve (the devcluster's do not).
        return self.launch(TRAINER, "trainer", argv, layout.trainer_nodes, 0,
                           ntasks=len(layout.trainer_nodes) * t.tasks_per_node,
                           gpus_per_node=t.actor_num_gpus_per_node, cpus_per_task=t.cpus_per_task,
                           env={"MASTER_ADDR": layout.head_address})


def steps_env(job: JobContext, key: str) -> dict[str, str]:
    """The environment of every step: ours, with the job's key and its directory."""
    return {**step_env(key), JOB_DIR_ENV: str(job.dir.root)}


def agent_shape(job: JobContext, key: str) -> AgentShape:
    """What each node agent step holds (steps.engine_launch: node_agent): a node's share of the
    engines' CPUs and GPUs, run as an engine step would be (its container, srun options, python)."""
    spec, r = job.spec, job.spec.rollout
    site, per_node = spec.steps, r.engines_on_each_node
    python = site.container_python if site.image("engine") else spec.python or sys.executable
    het_group = job.layout.engines[0].het_group if job.layout.engines and spec.het_groups > 1 else None
    return AgentShape(python, job.dir.logs, cpus_per_node=r.cpus_per_engine * per_node,
                      gpus_per_node=r.gpus_per_node, het_group=het_group,
                      options=tuple(srun_options(site, "engine")), env=steps_env(job, key),
                      workdir=slurm_env.submit_dir())


def engine_command(spec: JobSpec, place: EnginePlace, python: str) -> list[str]:
    """The command line of the engine at `place`, as its node-rank 0 runs it (the job's key joins it
    inside the step: _with_key). An engine over several nodes is one tensor-parallel group over all
    of them (SGLang's --tp-size counts every node's GPUs; the cpu engine has one rank per node)."""
    r = spec.rollout
    group_flags = engine_groups.engine_roles(spec)[place.index][1]  # the group's own, after the job's
    sglang_args = passthrough(r.sglang_args, "sglang") + list(group_flags)
    if r.offloads_rollout and "--enable-memory-saver" not in sglang_args:  # /release_memory_occupation needs it
        sglang_args.append("--enable-memory-saver")
    # The stand-in on GPUs (engine: standin) is one process on one GPU: --device cuda, --tp-size 1.
    tp = 1 if r.engine == "standin" else max(1, place.gpus_per_node) * len(place.nodes)
    launch = EngineLaunch(spec.trainer.hf_checkpoint, place.address, place.port, tp=tp, nnodes=len(place.nodes),
                          dist_init_addr=place.dist_init_addr, base_gpu_id=engine_base_gpu(spec, place),
                          sglang_args=sglang_args, role=place.role, bootstrap_port=place.bootstrap_port,
                          device="cuda" if r.engine == "standin" else None)
    return sglang_command(launch, python) if r.engine == "sglang" else cpu_engine_command(launch, python)


def engine_base_gpu(spec: JobSpec, place: EnginePlace) -> int:
    """Engine k's first GPU among those its step sees (in the order of the GPU list the node's steps
    all see): --colocate, its slice [k*tp, (k+1)*tp) of the node's; stand-in engines sharing GPUs,
    the node's GPUs in turn; otherwise 0, the first of the step's own GPUs."""
    r = spec.rollout
    slot = place.index % r.engines_on_each_node
    if r.engines_share_gpus:
        return slot % max(1, r.gpus_per_node)
    if r.colocate and place.gpus_per_node:
        return slot * place.gpus_per_node
    return 0


@dataclass(frozen=True)
class RouterPlace:
    url: str  # where the trainer and the supervisor reach it
    port: int
    metrics_port: int

    @classmethod
    def choose(cls, spec: JobSpec, layout: Layout, predecessor: JobState | None) -> RouterPlace:
        """The router runs on the head node, where the supervisor runs: its ports are checked free
        here (and kept on relaunch); a predecessor's router keeps its port (adopted, or relaunched
        on it). An external router (--sglang-router-ip) is used as given."""
        record = predecessor.steps.get(ROUTER) if predecessor else None
        port = (int(record.url.rsplit(":", 1)[1]) if record and record.url
                else layouts.port_free_here(layout.head_address, layout.router_port))
        metrics_port = layouts.port_free_here(layout.head_address, layout.router_metrics_port)
        r = spec.rollout
        url = (f"http://{r.sglang_router_ip}:{r.sglang_router_port}" if r.external_router
               else f"http://{layout.head_address}:{port}")
        return cls(url, port, metrics_port)


def _with_key(argv: list[str]) -> list[str]:
    """[python, -m, MODULE, ARGS...] run so that the job's key joins ARGS only inside the process."""
    python, dash_m, module, *args = argv
    if dash_m != "-m":
        raise ValueError(f"not a python -m command line: {argv}")
    return [python, "-m", "supervisor.with_key", module, *args]
