"""The rollout journal replays a rollout only to the run that generated it: the same checkpoint
lineage, the same flags (placement aside), the same rollout id; a save clears it. (The whole
trainer replaying after a kill, exactly: tests/trainer/test_rl_loop.py.)"""

from __future__ import annotations

from pathlib import Path

from rollout.sample import Sample, Status
from trainer.rollout_journal import FOLDER, INITIAL, RolloutJournal, new_lineage


def flags(**changed: object) -> dict[str, object]:
    base = {"lr": 1e-2, "num_rollout": 10, "seed": 7, "master_port": 29500, "sglang_router_ip": "10.0.0.1",
            "sglang_router_port": 30000, "api_key": "k1", "engine_urls": None}
    return {**base, **changed}


GROUPS = [[Sample(index=0, group_index=0, prompt="1+1", tokens=[5, 6, 7], response="2", response_length=1,
                  label="2", reward=1.0, loss_mask=[1], status=Status.COMPLETED, rollout_log_probs=[-0.1],
                  weight_version="3")]]
BUFFER = {"source": {"epoch": 0, "offset": 8}, "pending": []}


def test_the_same_run_replays_what_it_recorded(tmp_path: Path) -> None:
    journal = RolloutJournal(tmp_path / FOLDER, flags())
    journal.resumed("lineage-a")
    journal.record(4, GROUPS, BUFFER)
    # A restarted trainer: resumed from the same checkpoint, on other ports, with another key
    again = RolloutJournal(tmp_path / FOLDER, flags(master_port=29511, sglang_router_port=30007, api_key="k2"))
    again.resumed("lineage-a")
    groups, buffer = again.replay(4)
    assert [[s.to_dict() for s in g] for g in groups] == [[s.to_dict() for s in g] for g in GROUPS]
    assert buffer == BUFFER
    assert again.replay(5) is None  # not done before


def test_another_lineage_other_flags_or_an_old_checkpoint_generate_again(tmp_path: Path) -> None:
    journal = RolloutJournal(tmp_path / FOLDER, flags())
    journal.resumed("lineage-a")
    journal.record(4, GROUPS, BUFFER)
    other = RolloutJournal(tmp_path / FOLDER, flags())
    other.resumed("lineage-b")  # resumed from another checkpoint
    assert other.replay(4) is None
    changed = RolloutJournal(tmp_path / FOLDER, flags(lr=2e-2))  # a flag that changes the weights
    changed.resumed("lineage-a")
    assert changed.replay(4) is None
    old = RolloutJournal(tmp_path / FOLDER, flags())
    old.resumed(None)  # a checkpoint from before the journal: its lineage is unknown
    assert old.replay(4) is None
    old.record(5, GROUPS, BUFFER)
    assert not (tmp_path / FOLDER / "rollout_5.pt").exists()


def test_a_fresh_start_replays_a_fresh_start(tmp_path: Path) -> None:
    first = RolloutJournal(tmp_path / FOLDER, flags())
    assert first.lineage == INITIAL
    first.record(0, GROUPS, BUFFER)
    assert RolloutJournal(tmp_path / FOLDER, flags()).replay(0) is not None


def test_a_save_clears_the_journal_and_half_written_entries(tmp_path: Path) -> None:
    journal = RolloutJournal(tmp_path / FOLDER, flags())
    journal.record(0, GROUPS, BUFFER)
    journal.record(1, GROUPS, BUFFER)
    (tmp_path / FOLDER / ".rollout_2.pt.tmp-123").write_bytes(b"torn")
    lineage = new_lineage()
    journal.saved(lineage)
    assert list((tmp_path / FOLDER).iterdir()) == []
    journal.record(2, GROUPS, BUFFER)  # after the save: of the new lineage
    resumed = RolloutJournal(tmp_path / FOLDER, flags())
    resumed.resumed(lineage)
    assert resumed.replay(2) is not None


def test_an_unreadable_entry_is_generated_again(tmp_path: Path) -> None:
    (tmp_path / FOLDER).mkdir()
    (tmp_path / FOLDER / "rollout_3.pt").write_bytes(b"not a torch file")
    assert RolloutJournal(tmp_path / FOLDER, flags()).replay(3) is None
