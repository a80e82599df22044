"""The job spec's `steps` section on real srun (the devcluster has no Pyxis, so no image here; the
container options are tests/supervisor/test_step_options.py's): steps launched by the supervisor's
launcher into a running hetjob see what their setup lines exported, from where those lines cd'd,
with the role's own lines only in that role; the role's extra srun options reach srun (--label
prefixes every output line with its task number; --cpu-bind=none is accepted); a setup line that
fails fails the step before its command runs."""

from __future__ import annotations

from pathlib import Path

from contract.spec import RolloutSpec, StepsSpec
from supervisor.steps import StepController
from tests.supervisor import test_steps
from tests.supervisor.test_step_options import site_launcher

hetjob = test_steps.hetjob  # the fixture: a running two-group hetjob whose batch step sleeps

QUERY_S, EXIT_CODE_S = 20.0, 30.0
STEP_END_S = 60.0  # a one-line step, from srun to its exit
REPORT = 'echo "var=$SITE_VAR role=${ROLE_VAR-none} cwd=$PWD node=$SLURMD_NODENAME"'


def test_setup_lines_and_srun_options_run_on_real_srun(hetjob: tuple[str, dict[int, str]], tmp_path: Path) -> None:
    job_id, nodes = hetjob
    site = StepsSpec(setup=["export SITE_VAR='from setup'", "cd /tmp"], engine_setup=["export ROLE_VAR=engine"],
                     engine_srun_args=["--cpu-bind=none", "--label"], trainer_srun_args=["--cpu-bind=none"],
                     router_setup=["exit 3"])
    controller = StepController(job_id, QUERY_S, EXIT_CODE_S)
    launcher, _, job = site_launcher(tmp_path, site, RolloutSpec(engine="cpu", num_engines=1), [], (nodes[1],),
                                     steps=controller)
    marker = tmp_path / "router-ran"
    try:
        engine = launcher.launch("engine-0", "engine", ["bash", "-c", REPORT], (nodes[1],), 1, cpus_per_task=1)
        trainer = launcher.launch("trainer", "trainer", ["bash", "-c", REPORT], (nodes[0],), 0, cpus_per_task=1)
        router = launcher.launch("router", "router", ["touch", str(marker)], (nodes[0],), 0, overlap=True)
        codes = {name: step.proc.wait(STEP_END_S) for name, step in
                 (("engine", engine), ("trainer", trainer), ("router", router))}
    finally:
        job.events.close()
        controller.close()
    logs = {name: job.dir.log(name).read_text() for name in ("engine-0", "trainer", "router")}
    assert codes == {"engine": 0, "trainer": 0, "router": 3}, logs
    # srun's own lines (the devcluster's srun warns that it has no CPU binding to turn off) apart
    tasks = {name: [line for line in text.splitlines() if not line.startswith("srun: ")] for name, text in logs.items()}
    assert tasks["engine-0"] == [f"0: var=from setup role=engine cwd=/tmp node={nodes[1]}"], logs
    assert tasks["trainer"] == [f"var=from setup role=none cwd=/tmp node={nodes[0]}"], logs
    assert not marker.exists()  # the failed setup line stopped the router's step before its command
