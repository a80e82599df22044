"""The state store: round trip, fresh start, atomic saves, concurrent updates."""

from __future__ import annotations

import json
import threading
from dataclasses import asdict
from pathlib import Path

import pytest

from contract import job_dir as contract
from contract.job_dir import JobDir
from supervisor.state import JobState, StateStore, StepRecord, read_state


def engine(name: str) -> StepRecord:
    return StepRecord(name=name, kind="engine", het_group=1, nodes=["node2"], url="http://node2:30000")


def test_missing_file_is_a_fresh_start(tmp_path: Path) -> None:
    assert read_state(JobDir(tmp_path)) == JobState()
    assert StateStore(JobDir(tmp_path)).snapshot().steps == {}


def test_saved_state_reads_back_equal(tmp_path: Path) -> None:
    store = StateStore(JobDir(tmp_path))
    with store.update() as state:
        state.job_id = "110"
        state.weight_version = 3
        state.requeues = 1
        state.last_checkpoint = "/ckpt/iter_0000003"
        state.steps["engine-0"] = engine("engine-0")
    store.update_step("engine-0", state="healthy", slurm_step="111.4", restarts=2,
                      last_probe_latency_s=0.8, last_probe_time=1.5e9, last_failure="HTTP 503")
    again = StateStore(JobDir(tmp_path)).snapshot()
    assert again == store.snapshot()
    assert again.steps["engine-0"].slurm_step == "111.4" and again.updated_at is not None


def test_a_state_file_of_an_older_supervisor_reads_its_string_versions_as_ints(tmp_path: Path) -> None:
    """Older supervisors kept the weight version as a string; an engine's initial name is no version."""
    old = {"job_id": "110", "weight_version": "12", "requeues": 0,
           "steps": {"engine-0": {**asdict(engine("engine-0")), "weight_version": "11"},
                     "engine-1": {**asdict(engine("engine-1")), "weight_version": "default"}}}
    JobDir(tmp_path).state.write_text(json.dumps(old))
    state = StateStore(JobDir(tmp_path)).snapshot()
    assert state.weight_version == 12 and state.steps["engine-0"].weight_version == 11
    assert state.steps["engine-1"].weight_version is None


def test_a_failed_write_leaves_the_old_state_on_disk_and_in_memory(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    store = StateStore(JobDir(tmp_path))
    with store.update() as state:
        state.weight_version = 1
    before = JobDir(tmp_path).state.read_text()

    def crash(*args: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(contract.os, "replace", crash)
    with pytest.raises(OSError, match="disk full"), store.update() as state:
        state.weight_version = 2
    assert JobDir(tmp_path).state.read_text() == before
    assert store.snapshot().weight_version == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == [JobDir(tmp_path).state.name]  # no temp file left behind


def test_an_exception_inside_update_saves_nothing(tmp_path: Path) -> None:
    store = StateStore(JobDir(tmp_path))
    with pytest.raises(KeyError), store.update() as state:
        state.requeues = 5
        raise KeyError("boom")
    assert store.snapshot().requeues == 0 and not JobDir(tmp_path).state.exists()


def test_concurrent_updates_lose_nothing(tmp_path: Path) -> None:
    store = StateStore(JobDir(tmp_path))

    def bump() -> None:
        for _ in range(20):
            with store.update() as state:
                state.requeues += 1

    threads = [threading.Thread(target=bump) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert read_state(JobDir(tmp_path)).requeues == 80


def test_bad_values_are_refused(tmp_path: Path) -> None:
    store = StateStore(JobDir(tmp_path))
    with store.update() as state:
        state.steps["e"] = engine("e")
    with pytest.raises(ValueError, match="state must be one of"):
        store.update_step("e", state="dancing")
    assert store.snapshot().steps["e"].state == "starting"
    with pytest.raises(ValueError, match="kind must be one of"):
        StepRecord(name="x", kind="db", het_group=0, nodes=["node1"])
    JobDir(tmp_path).state.write_text(json.dumps({"job_id": "1", "surprise": 1}))
    with pytest.raises(ValueError, match="surprise"):
        read_state(JobDir(tmp_path))
