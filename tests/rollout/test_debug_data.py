"""Debug rollout dumps in slime's .pt layout, both ways. `SlimeSample` below copies the fields,
to_dict and from_dict of slime's Sample (slime/utils/types.py) and the dump is written and read
with the lines of slime's save_debug_rollout_data / load_debug_rollout_data
(slime/observability/rollout_data_utils.py): what slime writes loads here, ours loads there."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

import pytest
import torch

from rollout import debug_data
from rollout.sample import Sample, Status


@dataclass
class SlimeSample:
    group_index: int | None = None
    index: int | None = None
    rollout_id: int | None = None
    prompt: str | list[dict[str, str]] = ""
    tokens: list[int] = field(default_factory=list)
    multimodal_inputs: dict[str, Any] | None = None
    multimodal_train_inputs: dict[str, Any] | None = None
    multimodal_train_input_id: str | None = None
    apply_chat_template_kwargs: dict = field(default_factory=dict)
    response: str = ""
    response_length: int = 0
    label: str | None = None
    reward: float | dict[str, Any] | None = None
    loss_mask: list[int] | None = None
    weight_versions: list[str] = field(default_factory=list)
    rollout_log_probs: list[float] | None = None
    rollout_top_p_token_ids: Any = None
    rollout_top_p_token_offsets: Any = None
    rollout_routed_experts: Any = None
    remove_sample: bool = False
    teacher_log_probs: list[float] | None = None

    class Status(Enum):
        PENDING = "pending"
        COMPLETED = "completed"
        TRUNCATED = "truncated"
        ABORTED = "aborted"
        FAILED = "failed"

    status: Status = Status.PENDING
    metadata: dict = field(default_factory=dict)
    generate_function_path: str | None = None
    custom_rm_path: str | None = None
    train_metadata: dict | None = None
    session_id: str | None = None
    non_generation_time: float = 0.0
    # slime's SpecInfo / PrefixCacheInfo, as the dicts their to_dict() gives
    spec_info: dict = field(default_factory=lambda: {"spec_accept_token_num": 0, "spec_draft_token_num": 0,
                                                     "spec_verify_ct": 0, "completion_token_num": 0})
    prefix_cache_info: dict = field(default_factory=lambda: {"cached_tokens": 0, "total_prompt_tokens": 0})

    def to_dict(self) -> dict:
        value = self.__dict__.copy()
        value["status"] = self.status.value
        return value

    @staticmethod
    def from_dict(data: dict) -> SlimeSample:
        data = dict(data)
        data["status"] = SlimeSample.Status(data["status"])
        names = set(SlimeSample.__dataclass_fields__)
        sample = SlimeSample(**{k: v for k, v in data.items() if k in names})
        for key, value in data.items():
            if key not in names:
                setattr(sample, key, value)
        return sample


def slime_save(path_template: str, data: list[SlimeSample], rollout_id: int) -> None:
    path = Path(path_template.format(rollout_id=str(rollout_id)))
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"rollout_id": rollout_id, "samples": [sample.to_dict() for sample in data]}, path)


def slime_load(path_template: str, rollout_id: int) -> list[SlimeSample]:
    data = torch.load(path_template.format(rollout_id=rollout_id), weights_only=False)["samples"]
    return [SlimeSample.from_dict(sample) for sample in data]


def _slime_rollout() -> list[SlimeSample]:
    out = []
    for i in range(4):
        out.append(SlimeSample(group_index=i // 2, index=i, prompt=f"repeat {i}\n", tokens=[5, 6, 7 + i],
                               response=str(i), response_length=1, label=str(i % 2), reward=float(i % 2),
                               loss_mask=[1], weight_versions=["3"], rollout_log_probs=[-0.5 - i],
                               status=SlimeSample.Status.TRUNCATED if i == 3 else SlimeSample.Status.COMPLETED,
                               metadata={"row": i}, session_id=f"s{i}", non_generation_time=0.25))
    return out


def test_a_dump_slime_wrote_loads_as_the_same_samples(tmp_path: Path) -> None:
    template = str(tmp_path / "dump/{rollout_id}.pt")
    slime_samples = _slime_rollout()
    slime_save(template, slime_samples, rollout_id=2)
    groups = debug_data.load(template, 2)
    assert [[s.index for s in g] for g in groups] == [[0, 1], [2, 3]]
    for ours, theirs in zip([s for g in groups for s in g], slime_samples):
        assert (ours.group_index, ours.index, ours.prompt, ours.tokens, ours.response, ours.response_length,
                ours.label, ours.reward, ours.loss_mask, ours.rollout_log_probs, ours.metadata) == (
            theirs.group_index, theirs.index, theirs.prompt, theirs.tokens, theirs.response, theirs.response_length,
            theirs.label, theirs.reward, theirs.loss_mask, theirs.rollout_log_probs, theirs.metadata)
        assert ours.status.value == theirs.status.value and ours.weight_version == 3


def test_our_dump_loads_in_slime_with_its_fields(tmp_path: Path) -> None:
    template = str(tmp_path / "{rollout_id}.pt")
    ours = [Sample(index=i, group_index=0, prompt="p", tokens=[1, 2, 3], response="x", response_length=1,
                   label="x", reward=1.0, loss_mask=[1], status=Status.COMPLETED, rollout_log_probs=[-0.1],
                   weight_version=7, metadata={"row": 0}) for i in range(2)]
    written = debug_data.save(template, 5, ours)
    assert written == tmp_path / "5.pt"
    raw = torch.load(written, weights_only=False)
    # slime's fields, and slurmrl's spans (rollout.trace), which slime's from_dict keeps as an attribute
    assert raw["rollout_id"] == 5 and set(raw["samples"][0]) == set(SlimeSample.__dataclass_fields__) | {"spans"}
    theirs = slime_load(template, 5)
    assert theirs[0].spans == []
    assert [s.index for s in theirs] == [0, 1] and all(isinstance(s, SlimeSample) for s in theirs)
    assert theirs[0].status is SlimeSample.Status.COMPLETED and theirs[0].weight_versions == ["7"]
    assert (theirs[1].tokens, theirs[1].reward, theirs[1].loss_mask, theirs[1].rollout_log_probs) == (
        [1, 2, 3], 1.0, [1], [-0.1])
    # and back: our dump, read here, gives our samples
    assert [s for g in debug_data.load(template, 5) for s in g] == ours


def test_an_eval_dump_is_named_like_slimes(tmp_path: Path) -> None:
    path = debug_data.save(str(tmp_path / "{rollout_id}.pt"), 4, [Sample(index=0, group_index=0, prompt="p")],
                           evaluation=True)
    assert path.name == "eval_4.pt" and torch.load(path, weights_only=False)["rollout_id"] == 4


@pytest.mark.parametrize(("change", "message"), [
    ({"teacher_log_probs": [-1.0]}, "sets teacher_log_probs"),
    ({"reward": {"acc": 1.0}}, "dict reward"),
    ({"status": SlimeSample.Status.FAILED}, "status 'failed'"),
])
def test_a_slime_dump_slurmrl_cannot_replay_is_refused_naming_the_field(tmp_path: Path, change: dict,
                                                                        message: str) -> None:
    template = str(tmp_path / "{rollout_id}.pt")
    samples = _slime_rollout()
    for key, value in change.items():
        setattr(samples[1], key, value)
    slime_save(template, samples, rollout_id=0)
    with pytest.raises(debug_data.DebugDataError, match=message):
        debug_data.load(template, 0)


def test_a_missing_dump_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(debug_data.DebugDataError, match="0.pt does not exist"):
        debug_data.load(str(tmp_path / "{rollout_id}.pt"), 0)
