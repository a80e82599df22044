"""slurmrl report on job dirs made of real metrics.jsonl and events.jsonl lines (copied from
devcluster job runs: a prefill/decode job whose engine was killed and recovered, a run with eval
and saves, a job whose trainer failed three times): the PNGs decode, and what they draw follows the
data (an eval curve only where eval ran, failures only where something failed, phases only where
they took time). A dir that is no job is a one-line error."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy
import pytest
from matplotlib.image import imread

from jobs import cli
from contract.job_dir import JobDir
from supervisor.report import EVENTS, PHASES, REWARD, write_report

DATA = Path(__file__).parent / "data" / "report"
# matplotlib's default cycle: reward_mean is the first curve, the first eval set the second; the
# phases stack in PHASE_TIMES order with one colour each; events: failures red, recoveries green.
BLUE, ORANGE, GREEN, RED, PURPLE, BROWN = (31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), \
    (148, 103, 189), (140, 86, 75)


def job(tmp_path: Path, name: str) -> Path:
    folder = shutil.copytree(DATA / name, tmp_path / name)
    (folder / "spec.yaml").write_text("{}\n")  # what makes a folder a job dir for the CLI
    return folder


def report(folder: Path, capsys: pytest.CaptureFixture[str]) -> dict[str, numpy.ndarray]:
    assert cli.main(["report", str(folder)]) == 0
    printed = capsys.readouterr().out.split()
    images = {Path(p).name: imread(p) for p in printed}
    for name, image in images.items():
        assert Path(printed[0]).parent == folder / "report"
        assert image.shape[0] > 150 and image.shape[1] > 500, name
        assert (image[..., :3] < 0.95).any(axis=-1).mean() > 0.01, f"{name} is blank"
    return images


def pixels(image: numpy.ndarray, rgb: tuple[int, int, int]) -> int:
    """How many pixels have exactly this colour (to one 8-bit step)."""
    return int((numpy.abs(image[..., :3] * 255 - numpy.array(rgb)) <= 1.5).all(axis=-1).sum())


def test_a_job_with_a_killed_engine(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    images = report(job(tmp_path, "pd_job"), capsys)
    assert set(images) == {REWARD, PHASES, EVENTS}
    assert pixels(images[REWARD], BLUE) > 50 and pixels(images[REWARD], ORANGE) == 0  # no eval in this job
    assert pixels(images[PHASES], BLUE) > 2000  # generation dominates its rollouts
    assert pixels(images[PHASES], BROWN) == 0  # no eval time
    assert pixels(images[EVENTS], RED) > 10 and pixels(images[EVENTS], GREEN) > 10  # the kill and the recovery


def test_eval_and_saves_are_drawn(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    images = report(job(tmp_path, "eval_job"), capsys)
    assert set(images) == {REWARD, PHASES}  # no events.jsonl: no events plot
    assert pixels(images[REWARD], ORANGE) > 20  # eval/toy
    assert pixels(images[PHASES], BROWN) > 20 and pixels(images[PHASES], PURPLE) > 20  # eval and save time


def test_a_job_that_failed_before_its_first_rollout(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    images = report(job(tmp_path, "failed_job"), capsys)
    assert set(images) == {EVENTS}
    assert pixels(images[EVENTS], RED) > 30 and pixels(images[EVENTS], GREEN) > 10  # failures and restarts


def test_a_job_without_failures_draws_none(tmp_path: Path) -> None:
    folder = job(tmp_path, "pd_job")
    events = folder / "events.jsonl"
    events.write_text("".join(line + "\n" for line in events.read_text().splitlines()
                              if '"engine_failed"' not in line and '"engine_recovered"' not in line))
    [*_, path] = write_report(JobDir(folder))
    assert path.name == EVENTS and pixels(imread(path), RED) == pixels(imread(path), GREEN) == 0


def test_a_folder_that_is_no_job_is_a_one_line_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["report", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("slurmrl report: error: ") and "no spec.yaml" in err
    (tmp_path / "spec.yaml").write_text("{}\n")  # a job dir whose job has not started: nothing to plot
    assert cli.main(["report", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "has no metrics.jsonl or events.jsonl lines" in err
    assert not (tmp_path / "report").exists()


def test_a_line_that_is_not_json_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = job(tmp_path, "eval_job")
    with open(folder / "metrics.jsonl", "a") as f:
        f.write('{"rollout_id": 6, "reward_me\n')
    assert cli.main(["report", str(folder)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{folder / 'metrics.jsonl'}:7 is not JSON" in err
