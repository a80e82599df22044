"""Which reward a sample gets through generate_rollout: built-in types (a sample's own rm_type
first), --group-rm with slime's batched custom RM contract, a reward a custom generate already
set, dict rewards and --reward-key; and the trainer flags that configure them."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from rollout.buffer import DataBuffer
from rollout.data import JsonlDataSource
from rollout.errors import RolloutError
from rollout.generate import RolloutArgs, generate_rollout
from rollout.tiny_model import write_tiny_model
from slime.rollout.filter_hub.dynamic_sampling_filters import check_reward_nonzero_std
from tests.rollout import reward_plugins
from trainer.args import ArgsError, parse_args
from trainer.batch import TrainSample

PROMPTS, N = 3, 4
PLUGINS = "tests.rollout.reward_plugins"


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


def _args(model: Path, **kw) -> RolloutArgs:
    # The custom generate answers without an engine: the router is never called.
    return replace(RolloutArgs(hf_checkpoint=str(model), router_url="http://127.0.0.1:1", rollout_batch_size=PROMPTS,
                               n_samples_per_prompt=N, custom_generate_function_path=f"{PLUGINS}.answer_by_index"),
                   **kw)


def _buffer(tmp_path: Path, rows: list[dict] | None = None) -> DataBuffer:
    rows = rows or [{"input": f"what is {i}?", "label": str(10 + i)} for i in range(PROMPTS)]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return DataBuffer(JsonlDataSource(data, label_key="label", metadata_key="metadata", n_samples_per_prompt=N,
                                      shuffle=False))


def _rewards(groups) -> list:
    return [s.reward for g in groups for s in g]


def test_built_in_types_and_a_samples_own_type(model: Path, tmp_path: Path) -> None:
    rows = [{"input": "a", "label": "11"}, {"input": "b", "label": "12", "metadata": {"rm_type": "math"}},
            {"input": "c", "label": "13", "metadata": {"rm_type": "dapo"}}]
    groups = generate_rollout(_args(model, rm_type="deepscaler"), 0, _buffer(tmp_path, rows))
    right = [i % 2 == 0 for i in range(N)]  # even samples answer the label
    assert _rewards(groups[:2]) == [int(r) for r in right] * 2
    # dapo reads "Answer: ...", which this response does not have: -1 with [INVALID]
    assert _rewards(groups[2:]) == [{"score": -1.0, "acc": False, "pred": "[INVALID]"}] * N
    with pytest.raises(ValueError, match="no reward type: give --rm-type"):
        generate_rollout(_args(model), 0, _buffer(tmp_path))


def test_group_rm_gives_the_custom_rm_the_whole_group(model: Path, tmp_path: Path) -> None:
    reward_plugins.CALLS.clear()
    args = _args(model, group_rm=True, custom_rm_path=f"{PLUGINS}.group_rank")
    groups = generate_rollout(args, 0, _buffer(tmp_path))
    assert sorted(reward_plugins.CALLS) == [[g * N + k for k in range(N)] for g in range(PROMPTS)]
    assert _rewards(groups) == [float(k) for _ in range(PROMPTS) for k in range(N)]
    # a plain function works too; without --group-rm the same RM would get one sample
    reward_plugins.CALLS.clear()
    groups = generate_rollout(replace(args, custom_rm_path=f"{PLUGINS}.group_rank_sync"), 0, _buffer(tmp_path))
    assert len(reward_plugins.CALLS) == PROMPTS and _rewards(groups) == [float(k) for _ in groups for k in range(N)]
    # built-in types with --group-rm score each sample at the group's end
    groups = generate_rollout(_args(model, group_rm=True, rm_type="deepscaler"), 0, _buffer(tmp_path))
    assert _rewards(groups) == [int(k % 2 == 0) for _ in groups for k in range(N)]


def test_group_rm_must_return_one_reward_per_sample(model: Path, tmp_path: Path) -> None:
    args = _args(model, group_rm=True, custom_rm_path=f"{PLUGINS}.group_too_short")
    with pytest.raises(RolloutError, match=rf"with --group-rm must return one reward per sample .*a list of {N}\)"):
        generate_rollout(args, 0, _buffer(tmp_path))


def test_a_reward_the_generate_set_is_kept_and_dict_rewards_take_reward_key(model: Path, tmp_path: Path) -> None:
    groups = generate_rollout(_args(model, rm_type="math", custom_generate_function_path=f"{PLUGINS}.answer_and_score"),
                              0, _buffer(tmp_path))
    assert _rewards(groups) == [7.0] * PROMPTS * N
    args = _args(model, custom_rm_path=f"{PLUGINS}.per_sample", reward_key="score")
    groups = generate_rollout(args, 0, _buffer(tmp_path))
    samples = [s for g in groups for s in g]
    assert [TrainSample.from_sample(s, "score").reward for s in samples] == [float(s.index) for s in samples]
    assert [s.get_reward_value(args) for s in samples] == [float(s.index) for s in samples]
    assert check_reward_nonzero_std(args, groups[0]).keep  # slime's filters read the same value
    with pytest.raises(ValueError, match="--reward-key nope: sample 0's reward has only the keys score, length"):
        TrainSample.from_sample(samples[0], "nope")


def _parse(model: Path, tmp_path: Path, *flags: str):
    data = tmp_path / "data.jsonl"
    data.write_text('{"input": "x", "label": "1"}\n')
    return parse_args(["--hf-checkpoint", str(model), "--num-rollout", "1", "--n-samples-per-prompt", "2", "--prompt-data", str(data),
                       "--sglang-router-ip", "127.0.0.1", "--sglang-router-port", "30000", *flags])


@pytest.mark.parametrize("flags, message", [
    (["--rm-type", "dapo"], "--rm-type dapo gives a dict reward .*add --reward-key"),
    (["--rm-type", "remote_rm"], "--rm-type remote_rm needs --rm-url"),
    (["--rm-type", "nope"], "argument --rm-type: invalid choice: 'nope'"),
    (["--rm-max-retries", "0"], "--rm-max-retries must be 1 or more"),
    (["--rm-timeout", "0"], "--rm-timeout must be > 0"),
    (["--rm-concurrency", "0"], "--rm-concurrency must be 1 or more"),
    (["--apply-chat-template-kwargs", "{bad"], "--apply-chat-template-kwargs: not JSON"),
    (["--apply-chat-template-kwargs", "[1]"], r"\[1\] is not a JSON object"),
])
def test_bad_reward_and_data_flags_are_refused(model: Path, tmp_path: Path, flags: list[str], message: str) -> None:
    with pytest.raises(ArgsError, match=message):
        _parse(model, tmp_path, *flags)


def test_reward_flags_reach_the_rollout(model: Path, tmp_path: Path) -> None:
    from trainer.config.rollout_args import rollout_args

    args = _parse(model, tmp_path, "--rm-type", "boxed_dapo", "--reward-key", "score", "--group-rm",
                  "--rm-url", "http://rm:8000/score", "--rm-timeout", "5", "--apply-chat-template",
                  "--apply-chat-template-kwargs", '{"enable_thinking": false}')
    assert args.reward.eval_reward_key == "score"  # slime's default: --reward-key
    rollout = rollout_args(args, "http://127.0.0.1:30000", 10.0, None)
    assert (rollout.rm_type, rollout.reward_key, rollout.group_rm, rollout.rm_url, rollout.rm_timeout) == (
        "boxed_dapo", "score", True, "http://rm:8000/score", 5.0)
    assert rollout.apply_chat_template_kwargs == {"enable_thinking": False}
    assert _parse(model, tmp_path).reward.rm_type is None  # slime's default
