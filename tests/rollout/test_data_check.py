"""The prompt data read at submit by the trainer's own reader (rollout/data.py): a UTF-8 BOM is
accepted, a line that is not an object says so, a missing key names the key and its flag, a prompt
longer than the model's context is an error and one longer than --rollout-max-prompt-len a note
(slime drops it), each by file:line, within a named bound; `slurmrl submit --dry-run` reports them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rollout import data_check
from rollout.data import JsonlDataSource
from rollout.data_check import check_prompt_data
from rollout.tiny_model import MAX_POSITIONS, write_tiny_model
from tests.jobs.helpers import job_flags

ROOT = Path(__file__).resolve().parents[2]
GOOD = json.dumps({"input": "repeat 1", "label": "1"})


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def _check(model: Path, path: Path, notes: list[str] | None = None, **kwargs) -> list[str]:
    options = {"input_key": "input", "label_key": "label", "metadata_key": "metadata", "tool_key": "tools",
               "max_prompt_len": None, **kwargs}
    return check_prompt_data(path, hf_checkpoint=str(model), notes=[] if notes is None else notes, **options)


def test_a_utf8_bom_is_accepted_by_the_check_and_the_trainer(model: Path, tmp_path: Path) -> None:
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + (GOOD + "\n" + GOOD + "\n").encode())
    assert _check(model, path) == []
    assert len(JsonlDataSource(path, label_key="label").rows) == 2


def test_each_bad_row_is_named_by_file_and_line(model: Path, tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    lines = [GOOD, "[1, 2]", '"just a string"', json.dumps({"label": "1"}), json.dumps({"input": "x"}),
             "{not json", "x" * 10_000_000, GOOD]
    path.write_text("\n".join(json.dumps({"input": line, "label": "1"}) if len(line) > 1000 else line
                              for line in lines) + "\n")
    assert _check(model, path) == [
        f"{path}:2: not a JSON object (a list); each line must be an object with an 'input' field",
        f"{path}:3: not a JSON object (a str); each line must be an object with an 'input' field",
        f"{path}:4: no 'input' field (set --input-key to the prompt's field)",
        f"{path}:5: no 'label' field (check --label-key)",
        f"{path}:6: not valid JSON (Expecting property name enclosed in double quotes)",
        f"{path}:7: the prompt is longer than the model's context ({MAX_POSITIONS} tokens, "
        "max_position_embeddings); shorten or remove it",
    ]


def test_prompts_over_the_max_prompt_len_are_noted_as_dropped(model: Path, tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text(GOOD + "\n" + json.dumps({"input": "word " * 200, "label": "1"}) + "\n")
    notes: list[str] = []
    assert _check(model, path, notes, max_prompt_len=50) == []
    assert notes == [f"--prompt-data {path}: 1 prompts are longer than --rollout-max-prompt-len 50 tokens and will "
                     f"be dropped, as slime does (first: {path}:2)"]
    assert _check(model, path, max_prompt_len=2) == [
        f"--prompt-data {path}: every prompt is longer than --rollout-max-prompt-len 2 tokens; raise it"]


def test_the_check_stops_at_its_bound_and_says_so(model: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(data_check, "CHECK_MAX_ROWS", 3)
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join([GOOD] * 5 + ["[bad]"]) + "\n")
    notes: list[str] = []
    assert _check(model, path, notes) == []
    assert notes == [f"--prompt-data {path}: checked the first 3 rows (the submit-time bound is 3 rows or "
                     f"{data_check.CHECK_MAX_SECONDS:.0f} s); the trainer checks the rest as it reads them"]


def test_dry_run_reports_the_data(model: Path, tmp_path: Path) -> None:
    flags = job_flags(tmp_path, "datacheck")
    data = tmp_path / "bad.jsonl"
    data.write_text(GOOD + "\n[1]\n")
    flags[flags.index("--hf-checkpoint") + 1] = str(model)
    flags[flags.index("--prompt-data") + 1] = str(data)
    done = subprocess.run([sys.executable, "-m", "jobs.cli", "submit", "--dry-run", *flags], capture_output=True,
                          text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 2
    assert f"slurmrl submit: error: train_args: {data}:2: not a JSON object (a list)" in done.stderr
    assert not (tmp_path / "job").exists()
