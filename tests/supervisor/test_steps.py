"""Step control against the real devcluster: srun --jobid into a running hetjob, one batched
squeue per cycle, exits seen at once, scancel by step id, adoption after a supervisor restart."""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from slurm.devcluster import DevCluster
from slurm.devcluster.daemons import wait_for
from supervisor.node_agents import AgentShape, NodeAgentSteps
from supervisor.steps import Step, StepController, StepSpec, srun_argv
from tests.slurm_helpers import (
    sbatch,
    slurm,
    wait_file_contains,
    wait_job_gone,
    write_script,
)

QUERY_S, EXIT_CODE_S = 20.0, 30.0  # squeue/sacct bounds, as fault_tolerance gives them


def test_srun_argv_names_every_placement_flag() -> None:
    spec = StepSpec("engine-3", ("python", "-m", "x"), ("node2", "node3"), Path("/j/logs/engine-3.log"),
                    het_group=1, ntasks=2, gpus_per_node=4, cpus_per_task=6, overlap=True)
    assert srun_argv("110", spec) == [
        "srun", "--jobid=110", "--het-group=1", "--nodelist=node2,node3", "--nodes=2", "--ntasks=2", "--exact",
        "--gpus-per-node=4", "--cpus-per-task=6", "--overlap", "--job-name=engine-3",
        "--output=/j/logs/engine-3.log", "--open-mode=append", "--kill-on-bad-exit=1", "python", "-m", "x"]
    router = StepSpec("router", ("r",), ("node1",), Path("r.log"))
    assert "--gres=none" in srun_argv("7", router) and not any(a.startswith("--het-group") for a in srun_argv("7", router))
    with pytest.raises(ValueError, match="step name"):
        StepSpec("batch", ("x",), ("node1",), Path("l"))


def test_an_srun_refused_for_the_rate_limit_is_told_and_slows_the_launches(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    fake = tmp_path / "srun"  # as srun ends when slurmctld (rl_enable) refuses its step's RPC
    fake.write_text("#!/bin/sh\necho 'srun: error: Unable to create step for job 110: Rate limit exceeded, "
                    "please retry later' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    log = tmp_path / "engine-0.log"
    log.write_text("srun: error: Unable to create step for job 110: Rate limit exceeded, please retry later\n"
                   "an earlier launch's words are not this one's\n")
    scontrol = tmp_path / "scontrol"
    scontrol.write_text("#!/bin/sh\necho 'MaxStepCount            = 40000'\n")
    scontrol.chmod(0o755)
    controller = StepController("110", QUERY_S, EXIT_CODE_S)
    controller.slurm.steps.seen(0)
    rate = controller.slurm.pacer.rate
    step = controller.launch(StepSpec("engine-0", ("python", "-m", "x"), ("node2",), log))
    assert step.proc is not None and step.proc.wait(10) == 1
    assert controller.rate_limited(step) == ("srun: error: Unable to create step for job 110: Rate limit exceeded, "
                                             "please retry later")
    assert controller.slurm.pacer.rate == rate / 2
    fine = tmp_path / "ok.log"
    fine.write_text("srun: error: Unable to create step for job 110: Rate limit exceeded, please retry later\n")
    fake.write_text("#!/bin/sh\nexit 0\n")
    again = controller.launch(StepSpec("engine-1", ("python", "-m", "x"), ("node2",), fine))
    assert again.proc is not None and again.proc.wait(10) == 0
    assert controller.rate_limited(again) is None  # the words before its launch were another's
    assert controller.count() == (3, 40000, False)


def test_a_query_slurm_does_not_answer_is_unknown_not_dead(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = tmp_path / "squeue"
    fake.write_text("#!/bin/sh\necho 'slurm_load_jobs error: Socket timed out' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    controller = StepController("110", QUERY_S, EXIT_CODE_S)
    proc = subprocess.Popen(["sleep", "30"], stdin=subprocess.DEVNULL)
    try:
        assert controller.refresh([Step("engine-0", proc, "111.4")]) == {"engine-0": "unknown"}
        assert controller.adopt({"engine-0": "111.4"}) is None
    finally:
        proc.kill()
        proc.wait()


def test_exit_codes_from_accounting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = tmp_path / "sacct"
    fake.write_text("#!/bin/sh\nprintf '%s\\n' '110.3|COMPLETED|0:0' '111.4|FAILED|7:0' '111.5|CANCELLED by 0|0:9' "
                    "'110.6|NODE_FAIL|0:0' '110.7|RUNNING|0:0' '110.8|COMPLETED|0:0'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    codes = StepController("110", QUERY_S, EXIT_CODE_S).exit_codes(["110.3", "111.4", "111.5", "110.6", "110.7"])
    # Killed by signal 9: 137; a node failure is no success even at 0:0; a running step is left out.
    assert codes == {"110.3": 0, "111.4": 7, "111.5": 137, "110.6": 255}


@pytest.fixture
def hetjob(devcluster: DevCluster, tmp_path: Path) -> Iterator[tuple[str, dict[int, str]]]:
    """A running two-group hetjob whose batch step only sleeps; yields its id and each group's node."""
    script = write_script(tmp_path / "het.sh", f"""
#SBATCH --output={tmp_path}/batch.out --time=5
#SBATCH --nodes=1 --ntasks=2
#SBATCH hetjob
#SBATCH --nodes=1 --ntasks=2 --gres=gpu:1
sleep 600
""")
    job_id = sbatch(script)
    try:
        def groups() -> dict[int, str]:
            rows = [line.split("|") for line in slurm("squeue", "-h", "-j", job_id, "-o", "%i|%T|%N").split()]
            return {int(i.split("+")[1]): n for i, t, n in rows if t == "RUNNING"}

        wait_for(lambda: len(groups()) == 2, 60, f"hetjob {job_id} to run")
        yield job_id, groups()
    finally:
        slurm("scancel", job_id)
        wait_job_gone(job_id, timeout_s=60)


def test_steps_launch_show_in_one_query_exit_cancel_and_adopt(hetjob: tuple[str, dict[int, str]],
                                                              tmp_path: Path) -> None:
    job_id, nodes = hetjob
    exits: queue.Queue[tuple[str, int | None, float]] = queue.Queue()
    controller = StepController(job_id, QUERY_S, EXIT_CODE_S, on_exit=lambda s: exits.put((s.spec_name, s.returncode, time.monotonic())))
    trigger = tmp_path / "exit-now"

    def spec(name: str, group: int, command: str, gpus: int = 0) -> StepSpec:
        return StepSpec(name, ("bash", "-c", command), (nodes[group],), tmp_path / f"{name}.log",
                        het_group=group, gpus_per_node=gpus)

    steps: list[Step] = []
    try:
        steps = [
            controller.launch(spec("engine-0", 1, 'echo "$SLURMD_NODENAME $CUDA_VISIBLE_DEVICES"; exec sleep 300', 1)),
            controller.launch(spec("router", 0, 'echo "$SLURMD_NODENAME"; exec sleep 300')),
            controller.launch(spec("engine-1", 1, f"while [ ! -e {trigger} ]; do sleep 0.05; done; exit 7")),
        ]
        engine0, router, engine1 = steps
        wait_for(lambda: set(controller.refresh(steps).values()) == {"running"}, 60, "all three steps running")

        # One squeue per cycle, whatever the number of steps.
        calls: list[tuple[str, ...]] = []
        real_squeue = controller._squeue
        controller._squeue = lambda *a: calls.append(a) or real_squeue(*a)  # type: ignore[method-assign]
        assert controller.refresh(steps) == {"engine-0": "running", "router": "running", "engine-1": "running"}
        assert len(calls) == 1
        controller._squeue = real_squeue  # type: ignore[method-assign]

        # Each group's steps live under that group's own job id; step numbers are shared.
        ids = dict(line.split() for line in slurm("squeue", "-h", "-j", job_id, "-o", "%i %A").splitlines())
        assert router.slurm_step.split(".")[0] == ids[f"{job_id}+0"]
        assert engine0.slurm_step.split(".")[0] == engine1.slurm_step.split(".")[0] == ids[f"{job_id}+1"]
        wait_file_contains(tmp_path / "engine-0.log", "\n", timeout_s=30)
        wait_file_contains(tmp_path / "router.log", "\n", timeout_s=30)
        assert (tmp_path / "engine-0.log").read_text().split()[:2] == [nodes[1], "0"]
        assert (tmp_path / "router.log").read_text().split()[0] == nodes[0]

        # An exit is reported by the watcher thread at once, not at the next query.
        trigger.touch()
        touched = time.monotonic()
        name, code, seen = exits.get(timeout=30)
        assert (name, code) == ("engine-1", 7)
        assert seen - touched < 3.0, f"exit noticed after {seen - touched:.1f} s"

        # Cancel one step by its id: its srun ends, the router step is untouched.
        controller.cancel(engine0, timeout_s=30, term_grace_s=5)
        assert engine0.returncode is not None
        assert controller.refresh([engine0, router]) == {"engine-0": "exited", "router": "running"}
        assert engine0.slurm_step not in (controller.query() or {})

        # A new supervisor adopts what still runs, by recorded id and name, and nothing else; an
        # unrecorded (or stale) id falls back to the newest live step of that name, once.
        recorded = {"engine-0": engine0.slurm_step, "router": router.slurm_step, "engine-1": engine1.slurm_step}
        adopted_exits: queue.Queue[tuple[str, int | None]] = queue.Queue()
        successor = StepController(job_id, QUERY_S, EXIT_CODE_S, on_exit=lambda s: adopted_exits.put((s.spec_name, s.returncode)))
        adopted = successor.adopt(recorded)
        assert [(s.spec_name, s.slurm_step) for s in adopted] == [("router", router.slurm_step)]
        assert successor.adopt({"router": f"{job_id}.999"}) == []
        by_name = StepController(job_id, QUERY_S, EXIT_CODE_S).adopt({"router": None})
        assert [s.slurm_step for s in by_name] == [router.slurm_step]
        # A step that ended unwatched: its exit code from sacct, reported as its exit.
        successor.ended("engine-1", engine1.slurm_step)
        assert adopted_exits.get(timeout=10) == ("engine-1", 7)

        # An adopted step's end reaches on_exit with its exit code (a stand-in stands for srun).
        trigger.unlink()
        engine2 = controller.launch(spec("engine-2", 1, f"while [ ! -e {trigger} ]; do sleep 0.05; done; exit 5"))
        steps.append(engine2)
        wait_for(lambda: controller.refresh([engine2]) == {"engine-2": "running"}, 60, "engine-2 running")
        [adopted2] = successor.adopt({"engine-2": engine2.slurm_step})
        trigger.touch()
        wait_for(lambda: successor.refresh([adopted2]) and adopted2.returncode is not None, 60, "engine-2's exit")
        assert adopted_exits.get(timeout=10) == ("engine-2", 5)
        successor.cancel(adopted[0], timeout_s=30, term_grace_s=5)
        assert adopted_exits.get(timeout=10) == ("router", 128 + 15)
        assert successor.refresh(adopted) == {"router": "exited"}
        router.proc.wait(30)
    finally:
        for step in steps:
            if step.returncode is None:
                step.proc.kill()
                step.proc.wait()
        controller.close()
        if "successor" in locals():
            successor.close()


def test_engines_in_a_node_agent_start_exit_and_restart_through_one_step(hetjob: tuple[str, dict[int, str]],
                                                                        tmp_path: Path) -> None:
    """steps.engine_launch: node_agent on the real srun: its stdin and stdout are the channel; the
    agent's step holds the node's GPU and gives it to the engine that asks; an engine's exit comes
    back at once with its code; its relaunch is a message, not a step."""
    job_id, nodes = hetjob
    exits: queue.Queue[Step] = queue.Queue()
    srun_steps = StepController(job_id, QUERY_S, EXIT_CODE_S, on_exit=exits.put)
    shape = AgentShape(sys.executable, tmp_path, cpus_per_node=2, gpus_per_node=1, het_group=1,
                       env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    steps = NodeAgentSteps(srun_steps, shape, ("engine-0", "engine-1"), on_exit=exits.put)
    trigger = tmp_path / "exit-now"

    def spec(name: str, command: str, gpus: int = 0) -> StepSpec:
        return StepSpec(name, ("bash", "-c", command), (nodes[1],), tmp_path / f"{name}.log", het_group=1,
                        gpus_per_node=gpus, env={**(shape.env or {}), "ENGINE_NAME": name})

    try:
        engine0 = steps.launch(spec("engine-0", 'echo "$ENGINE_NAME $SLURMD_NODENAME gpus=$CUDA_VISIBLE_DEVICES"; '
                                                'exec sleep 300', gpus=1))
        engine1 = steps.launch(spec("engine-1", f"while [ ! -e {trigger} ]; do sleep 0.05; done; exit 7"))
        wait_file_contains(tmp_path / "engine-0.log", "\n", timeout_s=60)
        assert (tmp_path / "engine-0.log").read_text().split() == ["engine-0", nodes[1], "gpus=0"]
        wait_for(lambda: set(steps.refresh([engine0, engine1]).values()) == {"running"}, 60, "both engines running")
        [agent_step] = [sid for sid, (name, _) in (steps.query() or {}).items() if name == f"agent-{nodes[1]}"]
        assert engine0.slurm_step == engine1.slurm_step == agent_step  # where they run

        trigger.touch()
        touched = time.monotonic()
        assert exits.get(timeout=30) is engine1 and engine1.returncode == 7
        assert time.monotonic() - touched < 3.0
        trigger.unlink()
        again = steps.launch(spec("engine-1", "exec sleep 300"))
        wait_for(lambda: steps.refresh([again]) == {"engine-1": "running"}, 30, "engine-1 running again")
        assert sorted(name for name, _ in (steps.query() or {}).values()) == [f"agent-{nodes[1]}"]  # no new step
        assert steps.count().launched == 1

        steps.cancel(engine0, timeout_s=30, term_grace_s=5)
        assert engine0.returncode == 128 + 15 and again.returncode is None
    finally:
        steps.close()  # the agent ends, and with it engine-1
    wait_for(lambda: not (srun_steps.query() or {}), 60, "the agent's step to end")
    assert again.returncode is not None
