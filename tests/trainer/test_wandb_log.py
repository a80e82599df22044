"""--use-wandb: each rollout's metrics reach one W&B run (offline mode here: the real wandb client
writes its run file, which the test reads back), and a resumed trainer logs into the same run."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from contract.job_dir import JobDir
from rollout.tiny_model import write_tiny_model
from slurm.devcluster.daemons import wait_for
from trainer.args import ArgsError, parse_args

wandb = pytest.importorskip("wandb")
from wandb.proto import wandb_internal_pb2  # noqa: E402

HISTORY_FLUSH_S = 30.0  # a closed run's file until it holds the rows logged to it
_BLOCK, _HEADER = 32768, 7  # W&B's run file: a ":W&B" header, then LevelDB-log records


def _history(run_file: Path) -> list[dict[str, str]]:
    """The history rows of a W&B run file (its records are wandb_internal_pb2.Record)."""
    data, pos, part, rows = run_file.read_bytes(), _HEADER, b"", []
    while pos + _HEADER <= len(data):
        room = _BLOCK - pos % _BLOCK
        if room < _HEADER:
            pos += room
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + _HEADER])
        if kind == 0 and length == 0:  # block padding
            pos += room
            continue
        if pos + _HEADER + length > len(data):  # W&B is still writing this record: the rows so far
            break
        part += data[pos + _HEADER:pos + _HEADER + length]
        pos += _HEADER + length
        if kind in (1, 4):  # a whole record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(part)
            part = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): item.value_json for item in record.history.item})
    return rows


@pytest.fixture
def flags(tmp_path: Path) -> list[str]:
    model = write_tiny_model(tmp_path / "model")
    data = tmp_path / "data.jsonl"
    data.write_text('{"input": "repeat 1\\n", "label": "1"}\n')
    return ["--hf-checkpoint", str(model), "--num-rollout", "2", "--prompt-data", str(data),
            "--sglang-router-ip", "127.0.0.1", "--sglang-router-port", "30000", "--job-dir", str(tmp_path / "job"),
            "--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--global-batch-size", "4"]


def test_each_rollout_reaches_one_run_and_a_resume_continues_it(flags: list[str], tmp_path: Path) -> None:
    from trainer.wandb_log import WandbRun

    args = parse_args(flags + ["--use-wandb", "--wandb-mode", "offline", "--wandb-project", "p",
                               "--wandb-group", "g", "--wandb-always-use-train-step"])
    job_dir = JobDir(Path(args.run.job_dir))
    first = WandbRun(args.logging, job_dir, steps_per_rollout=args.steps_per_rollout, run_config=args.flat())
    first.log(0, {"loss": 0.5, "reward_mean": 0.25, "note": "text is not a number"})
    first.close()
    again = parse_args(flags + ["--use-wandb", "--wandb-mode", "offline", "--wandb-project", "p",
                                "--wandb-group", "g", "--wandb-always-use-train-step"])
    second = WandbRun(again.logging, job_dir, steps_per_rollout=again.steps_per_rollout, run_config=again.flat())
    assert second.run.id == first.run.id and second.run.group == first.run.group
    assert first.run.group.startswith("g_")  # slime's random suffix, chosen once per job
    second.log(1, {"loss": 0.25, "reward_mean": 0.75})
    second.close()

    def rows() -> list[dict[str, str]]:
        return [row for run in sorted(job_dir.root.glob("wandb/offline-run-*/run-*.wandb")) for row in _history(run)]

    # W&B's writer process may still be flushing the last run's file when finish() returns (seen in CI)
    wait_for(lambda: len(rows()) >= 2, HISTORY_FLUSH_S, "both runs' history in their files")
    assert [(r["_step"], r["loss"], r["reward_mean"], r["rollout/step"]) for r in rows()] == [
        ("2", "0.5", "0.25", "0"), ("4", "0.25", "0.75", "1")]  # 8 samples / 4 per step = 2 steps per rollout
    assert all("note" not in r for r in rows())


def test_wandb_flags_without_use_wandb_are_refused(flags: list[str]) -> None:
    with pytest.raises(ArgsError, match="--wandb-project has no effect without --use-wandb"):
        parse_args(flags + ["--wandb-project", "p"])


def test_tb_project_and_experiment_name_the_tensorboard_folder(flags: list[str], tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TENSORBOARD_DIR", raising=False)
    args = parse_args(flags + ["--use-tensorboard", "--tb-project-name", "proj", "--tb-experiment-name", "exp"])
    assert args.logging.tensorboard_dir == str(tmp_path / "job" / "tensorboard_log" / "proj" / "exp")
    monkeypatch.setenv("TENSORBOARD_DIR", str(tmp_path / "tb"))
    assert parse_args(flags + ["--use-tensorboard"]).logging.tensorboard_dir == str(tmp_path / "tb")


def test_without_a_mode_and_without_network_the_run_is_kept_offline(flags: list[str], tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    """Neither --wandb-mode nor WANDB_MODE, and the W&B server (here a closed port on 127.0.0.1)
    cannot be reached: the run is written offline in the job dir, and the log says how to sync it."""
    from tests.ports import free_port
    from trainer.wandb_log import WandbRun, reachable

    server = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    assert not reachable(server)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_BASE_URL", server)
    args = parse_args(flags + ["--use-wandb", "--wandb-project", "p"])
    job_dir = JobDir(Path(args.run.job_dir))
    with caplog.at_level("WARNING", logger="trainer.wandb_log"):
        run = WandbRun(args.logging, job_dir, steps_per_rollout=args.steps_per_rollout, run_config=args.flat())
    run.log(0, {"loss": 0.5})
    run.close()
    assert run.run.settings.mode == "offline"
    assert f"wandb sync {job_dir.root}/wandb/offline-run-*" in caplog.text and server in caplog.text
    wait_for(lambda: [r for f in job_dir.root.glob("wandb/offline-run-*/run-*.wandb") for r in _history(f)],
             HISTORY_FLUSH_S, "the offline run's history")
