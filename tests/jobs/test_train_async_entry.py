"""slime's entry script names at submission: `slurmrl submit train_async.py ...` is slime's
train_async.py (the trainer's --train-async), `train.py` the default loop; --colocate is refused with
train_async.py as slime refuses it, and the async flags are checked where they take effect. No
SLURM is asked (the capacity checks are skipped)."""

from __future__ import annotations

from pathlib import Path

import pytest

from contract.spec_loading import load_spec
from jobs import submit_cli, validate
from tests.jobs.helpers import job_flags


@pytest.fixture(autouse=True)
def no_slurm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(validate, "query_partitions", lambda timeout_s: None)


def submit(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = submit_cli.main(argv + ["--dry-run"])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_train_async_py_runs_the_trainer_with_train_async(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, script, err = submit(["train_async.py", *job_flags(tmp_path, "async")], capsys)
    assert code == 0, err
    spec, problems = load_spec(None, [*job_flags(tmp_path, "async"), "--train-async"])
    assert problems == [] and "--train-async" in spec.trainer.train_args
    code, _, err = submit(["train.py", *job_flags(tmp_path, "sync")], capsys)
    assert code == 0, err


def test_train_async_with_colocate_is_refused_as_slime_refuses_it(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = submit(["train_async.py", *job_flags(tmp_path, "async"), "--colocate"], capsys)
    assert code == 2
    assert "rollout.colocate: slime's train_async.py (--train-async) generates while the trainer trains" in err
    assert len([line for line in err.splitlines() if "colocate" in line]) == 1, "one line names it"


@pytest.mark.parametrize("flags, message", [
    (["--update-weights-interval", "2"], "--update-weights-interval 2 takes effect with --train-async"),
    (["--train-async", "--update-weights-interval", "0"], "--update-weights-interval must be 1 or more, got 0"),
])
def test_the_async_flags_are_refused_where_they_have_no_effect(tmp_path: Path, flags: list[str], message: str,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = submit([*job_flags(tmp_path, "bad"), *flags], capsys)
    assert code == 2 and message in err


def test_the_trainer_refuses_train_async_with_colocations_offloading(tmp_path: Path) -> None:
    from trainer.args import ArgsError, parse_args

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    with pytest.raises(ArgsError) as err:
        parse_args(["--hf-checkpoint", str(model), "--num-rollout", "1", "--train-async", "--offload-rollout",
                    "--engine-urls", "http://127.0.0.1:1", "--rollout-function-path", "m.f",
                    "--disable-rollout-global-dataset"])
    assert any(p.startswith("--train-async and the fully async rollout: the engines generate while the trainer "
                            "trains") for p in err.value.problems)
