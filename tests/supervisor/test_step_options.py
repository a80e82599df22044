"""The job spec's `steps` section in every srun the supervisor issues (contract/step_options.py): the
Pyxis options of each role's image, the role's extra srun options and its setup lines, for the
router, the engines (one node and several), the trainer, and their relaunches (an engine's
recovery, on its node or a spare; an in-job trainer restart). The devcluster has no Pyxis: these
are the command lines SLURM would get; tests/integration/test_step_setup.py runs setup lines and
srun options for real."""

from __future__ import annotations

import dataclasses
import queue
import shlex
import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from contract.job_dir import JobDir
from contract.spec import JobSpec, RolloutSpec, StepsSpec, TrainerSpec
from supervisor.context import JobContext
from supervisor.engines import Engines
from supervisor.events import EventLog
from supervisor.launcher import RouterPlace, StepLauncher
from supervisor.layout import EnginePlace, Layout
from supervisor.state import StateStore
from supervisor.step_control import StepCount
from supervisor.steps import Step, StepSpec, srun_argv
from tests.ports import free_port

HOST_PYTHON = "/host/venv/bin/python"
SITE = StepsSpec(container_image="nvcr.io#nvidia/pytorch:24.05-py3", engine_container_image="lmsysorg/sglang:v0.5.5",
                 container_mounts=["/lustre:/lustre", "/models:/models:ro+rprivate"], container_workdir="/work",
                 trainer_srun_args=["--cpu-bind=none"], engine_srun_args=["--mem-bind=local", "--network=sn"],
                 setup=["module load cuda/12.4", 'export NCCL_DEBUG="WARN INFO"'], engine_setup=["ulimit -n 65536"])


class RecordingSteps:
    """A StepController that records what it is asked to launch (srun is not run)."""

    def __init__(self) -> None:
        self.specs: list[StepSpec] = []

    def launch(self, spec: StepSpec) -> Step:
        self.specs.append(spec)
        return Step(spec.name, None)

    def count(self) -> StepCount:
        return StepCount(len(self.specs), None, False)

    def argv(self, name: str) -> list[str]:
        """The srun command line of the last launch of step `name`."""
        return srun_argv("100", [s for s in self.specs if s.name == name][-1])


def site_launcher(tmp_path: Path, site: StepsSpec, rollout: RolloutSpec, places: list[EnginePlace],
                  nodes: tuple[str, ...], steps: Any = None) -> tuple[StepLauncher, Any, JobContext]:
    """A launcher of a job with `site` as its steps section, launching through `steps` (a
    StepController; default a RecordingSteps); the caller closes job.events."""
    spec = JobSpec(job_dir=str(tmp_path), python=HOST_PYTHON, rollout=rollout, steps=site,
                   trainer=TrainerSpec(actor_num_gpus_per_node=0, train_args=["--hf-checkpoint", "/m"]))
    layout = Layout(job_id="100", head="node0", head_address="127.0.0.1", trainer_nodes=("node0",),
                    rollout_nodes=nodes, router_port=free_port(), router_metrics_port=free_port(),
                    trainer_master_port=free_port(), engines=tuple(places),
                    addresses={n: "127.0.0.1" for n in ("node0", *nodes)})
    job_dir = JobDir(tmp_path)
    store = StateStore(job_dir)
    engines = Engines(places, SimpleNamespace(alive=lambda: True), None, "key", listed_timeout_s=1.0, store=store)
    job = JobContext(spec=spec, dir=job_dir, layout=layout, events=EventLog(job_dir.events), store=store,
                     engines=engines, client=None, finished=threading.Event(), inbox=queue.Queue())
    steps = RecordingSteps() if steps is None else steps
    router = RouterPlace(f"http://127.0.0.1:{layout.router_port}", layout.router_port, layout.router_metrics_port)
    return StepLauncher(job, steps, "key", router), steps, job


@pytest.fixture
def two_engines(tmp_path: Path) -> Iterator[tuple[StepLauncher, RecordingSteps, JobContext]]:
    places = [EnginePlace(f"engine-{k}", k, ("node1",), "127.0.0.1", 31000 + k, 1, 0) for k in range(2)]
    launcher, steps, job = site_launcher(tmp_path, SITE, RolloutSpec(engine="cpu", num_engines=2), places,
                                     ("node1", "node2"))
    yield launcher, steps, job
    job.events.close()


def _split(argv: list[str]) -> tuple[list[str], list[str]]:
    """srun's options and the step's command: the command starts after --kill-on-bad-exit=1 and
    the options that follow it (every srun option starts with '-')."""
    k = argv.index("--kill-on-bad-exit=1") + 1
    while argv[k].startswith("-"):
        k += 1
    return argv[:k], argv[k:]


def _unwrapped(command: list[str], setup: list[str]) -> list[str]:
    """The command inside the setup wrapper, checked to run the setup lines first, in order."""
    assert command[:2] == ["bash", "-c"] and len(command) == 3, command
    *lines, last = command[2].split("\n")
    assert lines == ["set -e", *setup]
    assert last.startswith("exec ")
    return shlex.split(last.removeprefix("exec "))


def test_every_role_runs_in_its_image_with_its_options_after_its_setup(
        two_engines: tuple[StepLauncher, RecordingSteps, JobContext]) -> None:
    launcher, steps, job = two_engines
    launcher.launch_router()
    for engine in job.engines.values():
        launcher.launch_engine(engine)
    launcher.launch_trainer()
    mounts = "--container-mounts=/lustre:/lustre,/models:/models:ro+rprivate"
    expected = {"router": ("nvcr.io#nvidia/pytorch:24.05-py3", [], SITE.setup),
                "engine-0": ("lmsysorg/sglang:v0.5.5", ["--mem-bind=local", "--network=sn"],
                             [*SITE.setup, "ulimit -n 65536"]),
                "trainer": ("nvcr.io#nvidia/pytorch:24.05-py3", ["--cpu-bind=none"], SITE.setup)}
    for name, (image, extra, setup) in expected.items():
        options, command = _split(steps.argv(name))
        assert options[-3 - len(extra):] == [f"--container-image={image}", mounts, "--container-workdir=/work",
                                             *extra], options
        assert sum(o.startswith("--container-image") for o in options) == 1
        inner = _unwrapped(command, setup)
        assert inner[0] == "python3"  # the image's interpreter, not the submitting host's
        assert inner[1:3] == ["-m", "trainer" if name == "trainer" else "supervisor.with_key"]
    # slurmrl's own placement is untouched by the site's options
    router, engine, trainer = steps.argv("router"), steps.argv("engine-1"), steps.argv("trainer")
    assert "--overlap" in router and "--nodelist=node0" in router
    assert "--het-group=1" in engine and "--nodelist=node1" in engine and "--ntasks=1" in engine
    assert "--jobid=100" in trainer and "--het-group=0" in trainer
    assert _unwrapped(_split(engine)[1], [*SITE.setup, "ulimit -n 65536"])[3] == "rollout.cpu_engine"


def test_an_engine_relaunched_by_its_recovery_keeps_its_options_once(
        two_engines: tuple[StepLauncher, RecordingSteps, JobContext]) -> None:
    launcher, steps, job = two_engines
    engine = job.engines["engine-0"]
    launcher.launch_engine(engine)
    first = steps.argv("engine-0")
    launcher.launch_engine(engine)  # a recovery on the same node
    assert steps.argv("engine-0") == first
    engine.place = job.layout.moved(engine.place, {"node1": "node2"})  # a recovery on a spare node
    launcher.launch_engine(engine)
    moved = steps.argv("engine-0")
    assert "--nodelist=node2" in moved
    assert [a for a in moved if a != "--nodelist=node2"] == [a for a in first if a != "--nodelist=node1"]
    launcher.launch_trainer()
    trainer = steps.argv("trainer")
    launcher.launch_trainer()  # an in-job trainer restart (TrainerWatch.launch)
    assert _split(steps.argv("trainer"))[0] == _split(trainer)[0]
    assert len([s for s in steps.specs if s.name == "engine-0"]) == 3


def test_a_multinode_engine_wraps_its_node_rank_runner_in_the_setup(tmp_path: Path) -> None:
    rollout = RolloutSpec(engine="cpu", num_engines=1, rollout_num_gpus_per_engine=8, rollout_num_gpus_per_node=4)
    place = EnginePlace("engine-0", 0, ("node1", "node2"), "127.0.0.1", 31000, 1, 0, dist_init_port=31100)
    launcher, steps, job = site_launcher(tmp_path, SITE, rollout, [place], ("node1", "node2"))
    try:
        launcher.launch_engine(job.engines["engine-0"])
    finally:
        job.events.close()
    options, command = _split(steps.argv("engine-0"))
    assert "--nodes=2" in options and "--ntasks=2" in options and "--nodelist=node1,node2" in options
    assert "--container-image=lmsysorg/sglang:v0.5.5" in options and options[-2:] == ["--mem-bind=local",
                                                                                      "--network=sn"]
    inner = _unwrapped(command, [*SITE.setup, "ulimit -n 65536"])
    assert inner[:4] == ["python3", "-m", "supervisor.with_key", "supervisor.node_rank"]
    assert steps.specs[-1].env["SLURMRL_ENGINE_NODES"] == "node1,node2"


def test_only_the_roles_with_an_image_run_in_a_container(tmp_path: Path) -> None:
    site = StepsSpec(engine_container_image="lmsysorg/sglang:v0.5.5", container_python="/opt/py/bin/python",
                     router_srun_args=["--cpu-bind=none"])
    places = [EnginePlace("engine-0", 0, ("node1",), "127.0.0.1", 31000, 1, 0)]
    launcher, steps, job = site_launcher(tmp_path, site, RolloutSpec(engine="cpu", num_engines=1), places, ("node1",))
    try:
        launcher.launch_router()
        launcher.launch_engine(job.engines["engine-0"])
        launcher.launch_trainer()
    finally:
        job.events.close()
    router_options, router = _split(steps.argv("router"))
    assert not any(o.startswith("--container") for o in router_options) and router_options[-1] == "--cpu-bind=none"
    assert router[0] == HOST_PYTHON  # no setup lines: the command itself, as before
    engine_options, engine = _split(steps.argv("engine-0"))
    assert engine_options[-1] == "--container-image=lmsysorg/sglang:v0.5.5"  # no mounts or workdir given
    assert engine[0] == "/opt/py/bin/python"
    trainer_options, trainer = _split(steps.argv("trainer"))
    assert not any(o.startswith("--container") for o in trainer_options) and trainer[:3] == [HOST_PYTHON, "-m",
                                                                                            "trainer"]


def test_no_steps_section_leaves_every_command_line_as_it_was(tmp_path: Path) -> None:
    places = [EnginePlace("engine-0", 0, ("node1",), "127.0.0.1", 31000, 1, 0)]
    launcher, steps, job = site_launcher(tmp_path, StepsSpec(), RolloutSpec(engine="cpu", num_engines=1), places,
                                     ("node1",))
    try:
        launcher.launch_engine(job.engines["engine-0"])
    finally:
        job.events.close()
    spec = steps.specs[-1]
    assert spec.options == () and spec.argv[:3] == (HOST_PYTHON, "-m", "supervisor.with_key")
    bare = dataclasses.replace(spec, options=("--cpu-bind=none",))
    assert srun_argv("100", bare) == [*srun_argv("100", spec)[:-len(spec.argv)], "--cpu-bind=none", *spec.argv]
