"""The job spec's `steps` section: read from flags and YAML, checked at submission (one line per
problem, naming the field and the fix), kept through spec.yaml. Its rendering into srun is
tests/supervisor/test_step_options.py; `slurmrl submit` refusing it, tests/jobs/test_submit_invalid.py."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from contract import step_options
from contract.spec import StepsSpec
from contract.spec_loading import load_spec, spec_from_yaml
from jobs.validate import validate
from tests.jobs.helpers import job_flags


def test_flags_fill_the_steps_section(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SITE_DATA", "/lustre/data")
    spec, problems = load_spec(None, [
        "--container-image", "nvcr.io#nvidia/pytorch:24.05-py3", "--engine-container-image", "lmsysorg/sglang:v0.5.5",
        "--container-mounts", "${SITE_DATA}:/data,/models:/models:ro", "--container-workdir", "/work",
        "--engine-srun-args=--cpu-bind=none --mem-bind=local", "--step-setup", "module load cuda/12.4",
        "--step-setup", "export PATH=$HOME/bin:$PATH", "--router-setup", "ulimit -n 65536"])
    assert problems == []
    s = spec.steps
    assert s.image("engine") == "lmsysorg/sglang:v0.5.5" and s.image("router") == "nvcr.io#nvidia/pytorch:24.05-py3"
    assert s.container_mounts == ["/lustre/data:/data", "/models:/models:ro"]  # ${VAR}s expanded at submission
    assert s.srun_args("engine") == ["--cpu-bind=none", "--mem-bind=local"] and s.srun_args("trainer") == []
    # each --step-setup adds a line; the step's shell expands its $VARs, not submit
    assert s.setup_lines("router") == ["module load cuda/12.4", "export PATH=$HOME/bin:$PATH", "ulimit -n 65536"]
    assert s.setup_lines("trainer") == ["module load cuda/12.4", "export PATH=$HOME/bin:$PATH"]


def test_srun_options_given_as_a_flag_without_equals_say_how() -> None:
    _, problems = load_spec(None, ["--engine-srun-args", "--cpu-bind=none"])
    assert problems[0] == ("--engine-srun-args: takes one value, got 0; give the options after '=': "
                           "--engine-srun-args='--cpu-bind=none --mem=0'"), problems


def test_yaml_steps_survive_spec_yaml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("STEP_ONLY_VAR", raising=False)
    path = tmp_path / "job.yaml"
    path.write_text("steps:\n  container_image: img:1\n  container_mounts: [/a:/a]\n"
                    "  trainer_srun_args: [--cpu-bind=none]\n"
                    "  setup: ['export X=${STEP_ONLY_VAR:-1}', 'module load nccl']\n")
    spec, problems = load_spec(path, ["--step-setup", "source /site/env.sh"])  # a flag replaces the file's lines
    assert problems == []  # an unset $VAR in a setup line is the step's business
    assert spec.steps.setup == ["source /site/env.sh"]
    again = spec_from_yaml(spec.to_yaml())
    assert again.steps == spec.steps
    spec, problems = load_spec(path, [])
    assert spec_from_yaml(spec.to_yaml()).steps.setup == ["export X=${STEP_ONLY_VAR:-1}", "module load nccl"]


BAD = {
    "empty image": (StepsSpec(container_image=""), "steps.container_image: empty; give an image"),
    "empty role image": (StepsSpec(container_image="img", router_container_image=" "),
                         "steps.router_container_image: empty"),
    "two images": (StepsSpec(container_image="a,b"), "steps.container_image: 'a,b' is not one image"),
    "mount without target": (StepsSpec(container_image="img", container_mounts=["/data"]),
                             "steps.container_mounts: '/data' not SRC:DST[:FLAGS]"),
    "relative target": (StepsSpec(container_image="img", container_mounts=["/a:/a", "/data:data"]),
                        "steps.container_mounts: '/data:data' not SRC:DST[:FLAGS]"),
    "bad flags": (StepsSpec(container_image="img", container_mounts=["/a:/a:ro,rw"]),
                  "steps.container_mounts: '/a:/a:ro,rw' not SRC:DST[:FLAGS]"),
    "too many colons": (StepsSpec(container_image="img", container_mounts=["/a:/b:ro:x"]),
                        "steps.container_mounts: '/a:/b:ro:x'"),
    "relative workdir": (StepsSpec(container_image="img", container_workdir="work"),
                         "steps.container_workdir: 'work' is not an absolute path"),
    "mounts and no image": (StepsSpec(container_mounts=["/a:/a"]),
                            "steps.container_mounts/container_workdir: apply inside a container, and no step has one"),
    "owned srun options": (StepsSpec(engine_srun_args=["--cpu-bind=none", "--nodes=2", "--overlap", "--jobid=3"]),
                           "steps.engine_srun_args: --nodes=2, --overlap, --jobid=3 set by slurmrl itself"),
    "short and abbreviated": (StepsSpec(trainer_srun_args=["-N2", "-w", "node1", "--nodel=node1", "--het-g=1"]),
                              "steps.trainer_srun_args: -N2, -w, --nodel=node1, --het-g=1 set by slurmrl itself"),
    "container option as srun arg": (StepsSpec(router_srun_args=["--container-image=x"]),
                                     "steps.router_srun_args: --container-image=x set by slurmrl itself (use "
                                     "steps.container_image"),
    "empty setup line": (StepsSpec(setup=["module load x", ""]), "steps.setup/trainer_setup: an empty line"),
    "bad quoting": (StepsSpec(engine_setup=['export X="a b']), "steps.setup/engine_setup: bash cannot parse the "
                                                                "engine step's setup"),
    "empty container python": (StepsSpec(container_python=""), "steps.container_python: empty"),
    "unknown engine launch": (StepsSpec(engine_launch="agent"), "steps.engine_launch: 'agent'; give one of step, "
                                                                 "node_agent"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_steps_section_is_one_line_naming_the_field(case: str) -> None:
    steps, message = BAD[case]
    problems = step_options.problems(steps)
    assert len(problems) == 1 + (case == "empty setup line") * 2, problems  # that line is in every role's setup
    assert problems[0].startswith(message), problems


def test_a_good_steps_section_has_no_problems_and_passes_validation(tmp_path: Path) -> None:
    steps = StepsSpec(container_image="nvcr.io#nvidia/pytorch:24.05-py3", container_mounts=["/a:/a", "/m:/m:ro+rprivate"],
                      container_workdir="/work", engine_srun_args=["--cpu-bind=none", "--exclusive", "--mem=0",
                                                                   "--container-name=sglang"],
                      setup=["module load cuda", "export X='a b'"], trainer_setup=["cd /work && ls > /dev/null"])
    assert step_options.problems(steps) == []
    spec, problems = load_spec(None, job_flags(tmp_path, "good") + ["--container-image", "img:1",
                                                                    "--engine-srun-args=--nodes=2",
                                                                    "--engine-launch", "node_agent"])
    assert problems == [] and spec.steps.engine_launch == "node_agent"
    found = validate(spec, partitions=False)
    assert [p for p in found if p.startswith("steps.")] == [
        "steps.engine_srun_args: --nodes=2 set by slurmrl itself (the job spec's node counts place the steps); "
        "remove them"], found


def test_the_setup_wrapper_runs_the_lines_then_the_command_with_its_arguments_intact(tmp_path: Path) -> None:
    out = tmp_path / "out"
    argv = step_options.with_setup(["export GREETING='hello there'", "cd /"],
                                   ["bash", "-c", 'echo "$GREETING|$PWD|$1|$2" > "$3"', "_", "a b", "$HOME", str(out)])
    assert subprocess.run(argv, timeout=10).returncode == 0
    assert out.read_text() == "hello there|/|a b|$HOME\n"
    failing = step_options.with_setup(["false", f"touch {tmp_path}/ran"], ["true"])
    assert subprocess.run(failing, timeout=10).returncode == 1 and not (tmp_path / "ran").exists()


def test_paths_no_mount_shows_in_the_containers_are_a_note_at_submit(tmp_path: Path) -> None:
    from jobs.submit import prepare

    job_dir = tmp_path / "job"
    flags = job_flags(tmp_path, "mounts", job_dir) + ["--container-image", "img:1"]
    notes: list[str] = []
    prepare(None, flags + ["--container-mounts", "/elsewhere:/elsewhere"], partitions=False, notes=notes)
    top = "/" + tmp_path.parts[1]
    assert [n for n in notes if n.startswith("steps.")] == [
        f"steps.container_mounts: {job_dir}, {tmp_path / 'model'}, {tmp_path / 'toy.jsonl'}, "
        f"{job_dir / 'checkpoints'} under no SRC:DST mount with DST = SRC; the steps in containers see them only "
        f"if the image or enroot's own mounts hold them (add e.g. {top}:{top})"], notes
    notes.clear()
    prepare(None, flags + ["--container-mounts", f"{tmp_path}:{tmp_path}"], partitions=False, notes=notes)
    assert not [n for n in notes if n.startswith("steps.")], notes
    notes.clear()
    prepare(None, flags + ["--container-mounts", f"{tmp_path}:/data"], partitions=False, notes=notes)
    assert [n for n in notes if n.startswith("steps.")], "a mount at another path inside does not show the host path"
    assert not job_dir.exists()  # prepare writes nothing
