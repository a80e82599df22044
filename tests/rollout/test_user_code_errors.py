"""Users' code failing in the rollout. On single samples (a --custom-rm-path raising for 1 sample in
5, a hook, a group RM) the round goes on: each error is counted, the first of each function is
reported with its exception, and the sample gets reward 0 (--sample-error-policy zero_reward) or
its group is dropped (drop_group). Where a restart would fail again (every sample failed in the
function's own code, a rollout function calling a method slurmrl lacks, a function that does not
load) the round raises PluginError naming the function and the exception; the failures of what a
function talks to (a service that refuses connections) stay ordinary errors, left to restarts.
(Before, the first exception ended the rollout, and the trainer with it.)"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from rollout.buffer import DataBuffer
from rollout.data import JsonlDataSource
from rollout.errors import RolloutError
from rollout.generate import RolloutArgs, generate_rollout
from rollout.plugins import PluginError
from rollout.sample_errors import DROP_GROUP, ERROR_KEY, SampleErrors
from rollout.tiny_model import write_tiny_model
from tests.rollout import user_code_plugins as plugins
from trainer.batch import TrainSample

PROMPTS, N = 4, 5
PLUGINS = "tests.rollout.user_code_plugins"


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


def _args(model: Path, **kw) -> RolloutArgs:
    # The custom generate answers without an engine: the router is never called.
    return replace(RolloutArgs(hf_checkpoint=str(model), router_url="http://127.0.0.1:1", rollout_batch_size=PROMPTS,
                               n_samples_per_prompt=N, custom_generate_function_path=f"{PLUGINS}.in_place"), **kw)


def _buffer(tmp_path: Path, prompts: int = PROMPTS) -> DataBuffer:
    data = tmp_path / "d.jsonl"
    rows = [{"input": f"repeat: {i + 1}", "label": str(i + 1)} for i in range(prompts)]  # the toy task's digits
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return DataBuffer(JsonlDataSource(data, label_key="label", n_samples_per_prompt=N, shuffle=False))


def _reporter() -> tuple[SampleErrors, list[tuple[str, str, int]], SampleErrors]:
    reported: list[tuple[str, str, int]] = []
    return SampleErrors(on_first=lambda *first: reported.append(first)), reported, SampleErrors(DROP_GROUP)


def test_a_reward_raising_on_some_samples_gives_them_zero_and_is_counted(model: Path, tmp_path: Path) -> None:
    errors, reported, _ = _reporter()
    plugins.RAISED.clear()
    args = _args(model, custom_rm_path=f"{PLUGINS}.flaky_rm", sample_errors=errors)
    groups = generate_rollout(args, 0, _buffer(tmp_path))
    samples = [s for g in groups for s in g]
    assert len(samples) == PROMPTS * N and plugins.RAISED == [0, 5, 10, 15]  # the first of each group
    assert errors.total == len(plugins.RAISED)
    assert reported == [(f"--custom-rm-path {PLUGINS}.flaky_rm", "ValueError: cannot grade sample 0", 0)]  # once
    for s in samples:
        assert s.reward == (0.0 if s.index in plugins.RAISED else 1.0)
        assert (ERROR_KEY in s.metadata) == (s.index in plugins.RAISED)
        TrainSample.from_sample(s)
    # the count goes on across rounds; the first error was reported already
    generate_rollout(args, 1, _buffer(tmp_path))
    assert errors.total == 2 * PROMPTS == len(plugins.RAISED) and len(reported) == 1


def test_drop_group_leaves_out_the_groups_of_failed_samples(model: Path, tmp_path: Path) -> None:
    _, _, errors = _reporter()
    args = _args(model, custom_rm_path=f"{PLUGINS}.flaky_group_rm", group_rm=True, sample_errors=errors,
                 rollout_batch_size=2)
    groups = generate_rollout(args, 0, _buffer(tmp_path, prompts=8))
    assert [g[0].group_index for g in groups] == [0, 2]  # odd groups' reward raised: dropped, more were taken
    assert errors.total == 2 * N  # one per sample of groups 1 and 3
    assert all(s.reward == 1.0 for g in groups for s in g)


def test_a_hook_raising_drops_the_group(model: Path, tmp_path: Path) -> None:
    errors, reported, _ = _reporter()
    args = _args(model, rm_type="toy", n_samples_per_prompt=1, sample_errors=errors,
                 rollout_sample_hook_path=[f"{PLUGINS}.hook_raises_on_odd"])
    buffer = DataBuffer(JsonlDataSource(_buffer(tmp_path, prompts=8).source.path, label_key="label",
                                        n_samples_per_prompt=1, shuffle=False))
    groups = generate_rollout(args, 0, buffer)
    assert [g[0].index for g in groups] == [0, 2, 4, 6]  # a failed sample has nothing to train on
    assert reported[0][:2] == (f"--rollout-sample-hook-path {PLUGINS}.hook_raises_on_odd",
                               "RuntimeError: hook failed on 1")


def test_a_function_failing_on_every_sample_stops_the_round_naming_it(model: Path, tmp_path: Path) -> None:
    with pytest.raises(PluginError, match=rf"every one of the {PROMPTS * N} finished samples of rollout 3 failed in "
                                          rf"user code; the first: --custom-rm-path {PLUGINS}.broken_rm on sample "
                                          r"\d+: KeyError: 'score'") as raised:
        generate_rollout(_args(model, custom_rm_path=f"{PLUGINS}.broken_rm"), 3, _buffer(tmp_path))
    assert (raised.value.flag, raised.value.path) == ("--custom-rm-path", f"{PLUGINS}.broken_rm")
    # under drop_group the first batch says it already
    with pytest.raises(PluginError, match="AttributeError: 'Sample' object has no attribute "
                                          "'get_multimodal_train_inputs'"):
        generate_rollout(_args(model, custom_generate_function_path=f"{PLUGINS}.calls_a_missing_method",
                               sample_errors=SampleErrors(DROP_GROUP)), 0, _buffer(tmp_path))
    # a service that refuses every connection may be back after a restart: not fatal
    with pytest.raises(RolloutError, match="ConnectionRefusedError") as raised:
        generate_rollout(_args(model, custom_rm_path=f"{PLUGINS}.unreachable_rm"), 0, _buffer(tmp_path))
    assert not isinstance(raised.value, PluginError)


def test_errors_a_restart_would_repeat_name_the_function(model: Path, tmp_path: Path) -> None:
    args = _args(model, rollout_function_path=f"{PLUGINS}.rollout_calls_a_missing_method")
    with pytest.raises(PluginError, match=rf"--rollout-function-path {PLUGINS}.rollout_calls_a_missing_method raised "
                                          r"AttributeError: 'DataBuffer' object has no attribute "
                                          r"'get_samples_by_difficulty' in rollout 2"):
        generate_rollout(args, 2, _buffer(tmp_path))
    with pytest.raises(ConnectionError):  # not the function's own fault: left to the trainer's restarts
        generate_rollout(_args(model, rollout_function_path=f"{PLUGINS}.rollout_cannot_connect"), 0, _buffer(tmp_path))
    with pytest.raises(PluginError, match=r"--custom-rm-path 'tests.rollout.no_such_module.rm': cannot import"):
        generate_rollout(_args(model, custom_rm_path="tests.rollout.no_such_module.rm"), 0, _buffer(tmp_path))
