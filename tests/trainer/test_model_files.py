"""The model folder's config and tokenizer, kept in the job dir at submission (contract.job_dir's
keep_model_files): once the --hf-checkpoint folder is gone, a supervised trainer still builds its
config (a restart), reads the tokenizer, and publishes weight folders with config.json and the
tokenizer next to the weights. (The whole job: tests/integration/test_engine_faults.py.)"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from contract.job_dir import MODEL_FILES, JobDir, keep_model_files, model_files_dir
from rollout.tiny_model import write_tiny_model
from trainer.args import ArgsError, parse_args
from trainer.config.model_checks import read_hf_config
from trainer.weight_folders import WeightFolders


def _flags(model: Path, job_dir: Path, data: Path) -> list[str]:
    return ["--hf-checkpoint", str(model), "--num-rollout", "2", "--prompt-data", str(data), "--job-dir", str(job_dir),
            "--supervised", "--sglang-router-ip", "127.0.0.1", "--sglang-router-port", "30000",
            "--n-samples-per-prompt", "4"]


def test_a_supervised_trainer_needs_no_model_folder_once_its_files_are_kept(tmp_path: Path) -> None:
    model = write_tiny_model(tmp_path / "model")
    job = JobDir(tmp_path / "job")
    job.root.mkdir()
    data = tmp_path / "data.jsonl"
    data.write_text('{"input": "repeat 1\\n", "label": "1"}\n')
    kept = keep_model_files(model, job)
    assert "config.json" in kept and "tokenizer.json" in kept and set(kept) <= set(MODEL_FILES)
    assert sorted(p.name for p in job.model_files.iterdir()) == sorted(kept), "only the model's files, no weights"
    config = (model / "config.json").read_text()

    shutil.rmtree(model)  # deleted while the job runs
    assert model_files_dir(job, str(model)) == str(job.model_files)
    trainer = parse_args(_flags(model, job.root, data))  # what a restarted trainer builds first
    assert trainer.model.model_files == str(job.model_files) and trainer.model.hf_checkpoint == str(model)
    assert read_hf_config(trainer.model.model_files)["hidden_size"] == 64
    from transformers import AutoTokenizer
    assert AutoTokenizer.from_pretrained(trainer.model.model_files).encode("repeat 1")

    folders = WeightFolders(job, Path(trainer.model.model_files), shard_bytes=1 << 20, keep_versions=2)
    folder, _ = folders.write(3, [("w", torch.zeros(2))])
    assert (folder / "config.json").read_text() == config
    assert all((folder / name).is_file() for name in kept), "a published folder lacks the model's files"

    with pytest.raises(ArgsError, match="no config.json there"):  # unsupervised, nothing stands in for it
        parse_args([f for f in _flags(model, job.root, data) if f != "--supervised"])


def test_a_new_copy_replaces_the_old_one_whole(tmp_path: Path) -> None:
    job = JobDir(tmp_path / "job")
    job.root.mkdir()
    first = write_tiny_model(tmp_path / "first")
    keep_model_files(first, job)
    (job.model_files / "stale.txt").write_text("from an older job in this dir")
    second = tmp_path / "second"
    second.mkdir()
    (second / "config.json").write_text("{}")
    assert keep_model_files(second, job) == ["config.json"]
    assert [p.name for p in job.model_files.iterdir()] == ["config.json"]
    assert not [p for p in job.root.iterdir() if p.name.startswith(".")], "a temporary folder was left"
