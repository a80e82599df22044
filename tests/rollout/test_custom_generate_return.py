"""What a --custom-generate-function-path returns takes its argument's place, as in slime: a new
Sample, or a list of them from one call (each then of the argument's group), or None for an
argument filled in place. A group with a sample left unfinished never reaches the trainer: it is
dropped and counted, and a generate that leaves every sample unfinished stops the round, naming
itself. (Before, the return value was dropped: the untouched argument reached training PENDING,
unscored and empty.)"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from rollout.buffer import DataBuffer
from rollout.data import JsonlDataSource
from rollout.generate import RolloutArgs, generate_rollout
from rollout.plugins import PluginError
from rollout.sample import Status
from rollout.sample_errors import SampleErrors
from rollout.tiny_model import write_tiny_model
from trainer.batch import TrainSample

PROMPTS, N = 3, 4
PLUGINS = "tests.rollout.user_code_plugins"


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


def _args(model: Path, generate: str, **kw) -> RolloutArgs:
    # The custom generates answer without an engine: the router is never called.
    return replace(RolloutArgs(hf_checkpoint=str(model), router_url="http://127.0.0.1:1", rollout_batch_size=PROMPTS,
                               n_samples_per_prompt=N, rm_type="toy",
                               custom_generate_function_path=f"{PLUGINS}.{generate}"), **kw)


def _buffer(tmp_path: Path, prompts: int = PROMPTS) -> DataBuffer:
    data = tmp_path / "d.jsonl"
    rows = [{"input": f"repeat: {i + 1}", "label": str(i + 1)} for i in range(prompts)]  # the toy task's digits
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return DataBuffer(JsonlDataSource(data, label_key="label", n_samples_per_prompt=N, shuffle=False))


def _check_trainable(groups) -> None:
    for group in groups:
        assert len({s.group_index for s in group}) == 1
        for s in group:
            assert s.status is Status.COMPLETED and s.response_length == 2 and s.reward in (0.0, 1.0)
            TrainSample.from_sample(s)  # what the trainer takes


def test_a_new_sample_returned_takes_its_arguments_place(model: Path, tmp_path: Path) -> None:
    groups = generate_rollout(_args(model, "new_sample"), 0, _buffer(tmp_path))
    assert [len(g) for g in groups] == [N] * PROMPTS
    _check_trainable(groups)
    assert [s.reward for g in groups for s in g] == [1.0, 0.0] * (PROMPTS * N // 2)  # even samples answer the label


def test_a_list_returned_joins_the_arguments_group(model: Path, tmp_path: Path) -> None:
    groups = generate_rollout(_args(model, "fan_out"), 0, _buffer(tmp_path))
    assert [len(g) for g in groups] == [2 * N] * PROMPTS  # both samples of every call, in the argument's group
    _check_trainable(groups)
    assert [g[0].group_index for g in groups] == list(range(PROMPTS))
    assert [s.reward for s in groups[0]] == [1.0, 0.0] * N


def test_none_keeps_the_argument_filled_in_place(model: Path, tmp_path: Path) -> None:
    groups = generate_rollout(_args(model, "in_place"), 0, _buffer(tmp_path))
    _check_trainable(groups)
    assert all(s.reward == 1.0 for g in groups for s in g)


def test_a_group_with_an_unfinished_sample_never_reaches_the_trainer(model: Path, tmp_path: Path) -> None:
    errors = SampleErrors()
    # Odd samples come back PENDING: only groups of one sample can be whole here.
    args = _args(model, "forgets_status", n_samples_per_prompt=1, sample_errors=errors)
    buffer = DataBuffer(JsonlDataSource(_buffer(tmp_path, prompts=8).source.path, label_key="label",
                                        n_samples_per_prompt=1, shuffle=False))
    groups = generate_rollout(args, 0, buffer)
    assert [g[0].index for g in groups] == [0, 2, 4]  # the unfinished ones' groups were dropped, more were taken
    _check_trainable(groups)
    assert errors.total == 3  # samples 1, 3 and 5


def test_a_generate_leaving_every_sample_unfinished_stops_the_round(model: Path, tmp_path: Path) -> None:
    # every group has an odd sample: a second batch would be dropped as the first was
    with pytest.raises(PluginError, match=rf"no group of rollout 0 can be trained on: each of the {PROMPTS} finished "
                                          rf"groups had a sample that failed in user code \({PROMPTS * N // 2} of "
                                          rf"{PROMPTS * N} samples\); the first: --custom-generate-function-path "
                                          rf"{PLUGINS}.forgets_status on sample \d+: UnfinishedSample: sample \d+ "
                                          "came back with status pending"):
        generate_rollout(_args(model, "forgets_status"), 0, _buffer(tmp_path))
    with pytest.raises(PluginError, match=r"returns_a_dict on sample 0: BadReturn: returned dict"):
        generate_rollout(_args(model, "returns_a_dict"), 0, _buffer(tmp_path))
