"""The rollout journal replays a rollout only to the run that generated it: the same checkpoint
lineage, the same flags (placement aside), the same rollout id; a save clears it. (The whole
trainer replaying after a kill, exactly: tests/trainer/test_rl_loop.py.)"""

from __future__ import annotations

from pathlib import Path

from contract.job_dir import JobDir
from rollout.sample import Sample, Status
from trainer.rollout_journal import (
    INITIAL,
    LINEAGE_KEY,
    RolloutJournal,
    fingerprint,
    new_lineage,
)


def flags(**changed: object) -> str:
    """The fingerprint of a trainer's flags, with `changed` ones."""
    base = {"lr": 1e-2, "num_rollout": 10, "seed": 7, "master_port": 29500, "sglang_router_ip": "10.0.0.1",
            "sglang_router_port": 30000, "api_key": "k1", "engine_urls": None}
    return fingerprint({**base, **changed})


GROUPS = [[Sample(index=0, group_index=0, prompt="1+1", tokens=[5, 6, 7], response="2", response_length=1,
                  label="2", reward=1.0, loss_mask=[1], status=Status.COMPLETED, rollout_log_probs=[-0.1],
                  weight_version=3)]]
BUFFER = {"source": {"epoch": 0, "offset": 8}, "pending": []}


def test_the_same_run_replays_what_it_recorded(tmp_path: Path) -> None:
    journal = RolloutJournal(JobDir(tmp_path).rollout_journal, flags())
    journal.resumed("lineage-a")
    journal.record(4, GROUPS, BUFFER)
    # A restarted trainer: resumed from the same checkpoint, on other ports, with another key
    again = RolloutJournal(JobDir(tmp_path).rollout_journal, flags(master_port=29511, sglang_router_port=30007, api_key="k2"))
    again.resumed("lineage-a")
    groups, buffer = again.replay(4)
    assert [[s.to_dict() for s in g] for g in groups] == [[s.to_dict() for s in g] for g in GROUPS]
    assert buffer == BUFFER
    assert again.replay(5) is None  # not done before


def test_another_lineage_other_flags_or_an_old_checkpoint_generate_again(tmp_path: Path) -> None:
    journal = RolloutJournal(JobDir(tmp_path).rollout_journal, flags())
    journal.resumed("lineage-a")
    journal.record(4, GROUPS, BUFFER)
    other = RolloutJournal(JobDir(tmp_path).rollout_journal, flags())
    other.resumed("lineage-b")  # resumed from another checkpoint
    assert other.replay(4) is None
    changed = RolloutJournal(JobDir(tmp_path).rollout_journal, flags(lr=2e-2))  # a flag that changes the weights
    changed.resumed("lineage-a")
    assert changed.replay(4) is None
    old = RolloutJournal(JobDir(tmp_path).rollout_journal, flags())
    old.resumed(None)  # a checkpoint from before the journal: its lineage is unknown
    assert old.replay(4) is None
    old.record(5, GROUPS, BUFFER)
    assert not (JobDir(tmp_path).rollout_journal / "rollout_5.pt").exists()


def test_a_fresh_start_replays_a_fresh_start(tmp_path: Path) -> None:
    first = RolloutJournal(JobDir(tmp_path).rollout_journal, flags())
    assert first.lineage == INITIAL
    first.record(0, GROUPS, BUFFER)
    assert RolloutJournal(JobDir(tmp_path).rollout_journal, flags()).replay(0) is not None


def test_a_save_clears_the_journal_and_half_written_entries(tmp_path: Path) -> None:
    journal = RolloutJournal(JobDir(tmp_path).rollout_journal, flags())
    journal.record(0, GROUPS, BUFFER)
    journal.record(1, GROUPS, BUFFER)
    (JobDir(tmp_path).rollout_journal / ".rollout_2.pt.tmp-123").write_bytes(b"torn")
    lineage = new_lineage()
    journal.saved(lineage)
    assert list((JobDir(tmp_path).rollout_journal).iterdir()) == []
    journal.record(2, GROUPS, BUFFER)  # after the save: of the new lineage
    resumed = RolloutJournal(JobDir(tmp_path).rollout_journal, flags())
    resumed.resumed(lineage)
    assert resumed.replay(2) is not None


def test_an_unreadable_entry_is_generated_again(tmp_path: Path) -> None:
    (JobDir(tmp_path).rollout_journal).mkdir()
    (JobDir(tmp_path).rollout_journal / "rollout_3.pt").write_bytes(b"not a torch file")
    assert RolloutJournal(JobDir(tmp_path).rollout_journal, flags()).replay(3) is None


def test_the_lineage_travels_through_the_checkpoint_state(tmp_path: Path) -> None:
    journal = RolloutJournal(JobDir(tmp_path).rollout_journal, flags())
    journal.record(2, GROUPS, BUFFER)
    state = journal.state_dict()
    assert state[LINEAGE_KEY] != journal.state_dict()[LINEAGE_KEY], "each save has its own lineage"
    journal.checkpointed(state)  # the checkpoint holding `state` is written: the entries go
    assert journal.replay(2) is None and journal.lineage == state[LINEAGE_KEY]
    journal.record(3, GROUPS, BUFFER)
    resumed = RolloutJournal(JobDir(tmp_path).rollout_journal, flags())
    resumed.load_state_dict(state)
    assert resumed.replay(3) is not None
    before_the_journal = RolloutJournal(JobDir(tmp_path).rollout_journal, flags())
    before_the_journal.load_state_dict({})  # a checkpoint without a lineage: nothing replays
    assert before_the_journal.replay(3) is None
