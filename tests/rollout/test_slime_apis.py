"""slime's plug-in APIs at slime's import paths, with slime's signatures and behaviour: the ones
slime's examples import (GenerateState, Sample.append_response_tokens, optional index and
group_index, rm_hub's async_rm / batched_async_rm / math_dapo_utils / grade_answer_verl,
slime.utils.misc.load_function, RolloutFnTrainOutput, the data source's get_samples/add_samples)
and how the rollout calls plug-ins (evaluation= to a custom generate that names it, a rollout
function by keyword, its metrics reported). None of these existed before: each import fails on main."""

from __future__ import annotations

import asyncio
import json
import sys
from argparse import Namespace
from pathlib import Path

import pytest

from rollout.buffer import DataBuffer
from rollout.data import JsonlDataSource
from rollout.generate import RolloutArgs, generate_rollout, run_rollout
from rollout.sample import Sample, Status
from slime.rollout.rm_hub import async_rm, batched_async_rm, grade_answer_verl
from slime.rollout.rm_hub.math_dapo_utils import compute_score
from slime.rollout.sglang_rollout import GenerateState
from slime.utils.misc import SingletonMeta, load_function

PLUGINS = "tests.rollout.slime_plugins"
IFBENCH_STANDIN = Path(__file__).parent / "ifbench_standin"


def _buffer(tmp_path: Path, prompts: int, n: int) -> DataBuffer:
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"input": f"repeat: {i + 1}", "label": str(i + 1)}) + "\n"
                            for i in range(prompts)))
    return DataBuffer(JsonlDataSource(data, label_key="label", n_samples_per_prompt=n, shuffle=False))


# ---- Sample ------------------------------------------------------------------------------------
def test_append_response_tokens_keeps_mask_and_log_probs_aligned_as_slimes() -> None:
    sample = Sample(prompt="p", tokens=[1, 2])  # no index or group_index: optional, as in slime
    assert (sample.index, sample.group_index) == (None, None)
    mask = sample.loss_mask  # retool holds the list it cleared and reads it back
    sample.append_response_tokens(None, tokens=[3, 4], log_probs=[-0.1, -0.2], text="ab",
                                  meta_info={"finish_reason": {"type": "stop"}, "weight_version": "3"})
    sample.append_response_tokens(None, tokens=[5], trainable=False)  # a tool's output
    assert (sample.tokens, sample.response, sample.response_length) == ([1, 2, 3, 4, 5], "ab", 3)
    assert mask is sample.loss_mask and mask == [1, 1, 0]
    assert sample.rollout_log_probs == [-0.1, -0.2, 0.0]
    assert (sample.status, sample.weight_version, sample.effective_response_length) == (Status.COMPLETED, 3, 2)
    sample.append_response_tokens(None, tokens=[6], log_probs=[-1.0], meta_info={"finish_reason": {"type": "length"}})
    assert sample.status is Status.TRUNCATED and sample.loss_mask == [1, 1, 0, 1]


@pytest.mark.parametrize("kwargs, message", [
    ({"tokens": [1]}, "trainable response tokens require rollout log probabilities"),
    ({"tokens": [1], "log_probs": [0.0], "trainable": False}, "should not pass rollout log probabilities"),
    ({"tokens": [1, 2], "log_probs": [0.0]}, "log_probs length 1 != tokens length 2"),
])
def test_append_response_tokens_refuses_what_slimes_refuses(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Sample(prompt="p").append_response_tokens(None, **kwargs)


def test_a_plugins_own_attributes_survive_to_dict() -> None:
    sample = Sample(index=0, group_index=0, prompt="p")
    sample.tool_call_count = 3  # retool's
    again = Sample.from_dict(sample.to_dict())
    assert again.tool_call_count == 3 and again == sample


# ---- calling plug-ins ---------------------------------------------------------------------------
def test_a_custom_generate_naming_evaluation_gets_it(model: Path, tmp_path: Path) -> None:
    args = RolloutArgs(hf_checkpoint=str(model), router_url="http://127.0.0.1:1", rollout_batch_size=2,
                       n_samples_per_prompt=2, rm_type="toy",
                       custom_generate_function_path=f"{PLUGINS}.generate_with_evaluation")
    for evaluation in (False, True):
        groups = generate_rollout(args, 0, _buffer(tmp_path, 2, 2), evaluation=evaluation)
        samples = [s for g in groups for s in g]
        assert [s.metadata["evaluation"] for s in samples] == [evaluation] * 4
        # the new Samples stand in their arguments' place: index and group taken from them
        assert [(s.index, s.group_index) for s in samples] == [(0, 0), (1, 0), (2, 1), (3, 1)]
        assert [s.reward for s in samples] == [1.0] * 4


def test_a_rollout_function_returns_slimes_train_output_with_metrics(model: Path, tmp_path: Path) -> None:
    args = RolloutArgs(hf_checkpoint=str(model), router_url="http://127.0.0.1:1", rollout_batch_size=2,
                       n_samples_per_prompt=2, rollout_function_path=f"{PLUGINS}.rollout_with_metrics",
                       plugin_args=Namespace(rollout_batch_size=2))
    buffer = _buffer(tmp_path, 4, 2)
    output = run_rollout(args, 0, buffer)
    assert output.metrics == {"my_metric": 7.0}
    groups = output.samples
    assert [[(s.index, s.group_index) for s in g] for g in groups] == [[(0, 0), (1, 0)], [(2, 1), (3, 1)], [(4, 2)]]
    assert groups[0][0].status is Status.TRUNCATED and groups[2][0].prompt == "extra"
    # the group given back with add_samples comes first next time (slime's data source)
    assert [s.index for g in buffer.get_samples(1) for s in g] == [4, 5]


def test_slimes_load_function_and_generate_state(model: Path) -> None:
    assert load_function(f"{PLUGINS}.one_rm") is load_function(f"{PLUGINS}.one_rm")  # cached, as slime's
    with pytest.raises(ModuleNotFoundError):
        load_function("tests.rollout.no_such_module.f")
    SingletonMeta.clear_instances(GenerateState)
    args = Namespace(hf_checkpoint=str(model), rollout_temperature=0.7, rollout_top_p=0.9, rollout_top_k=5,
                     rollout_max_response_len=12, rollout_stop=None, rollout_stop_token_ids=None,
                     rollout_skip_special_tokens=False, rollout_concurrency=3)
    state = GenerateState(args)
    assert GenerateState(Namespace()) is state  # slime's singleton: the first args win
    assert state.tokenizer("hello", add_special_tokens=False)["input_ids"]
    assert state.sampling_params == {"temperature": 0.7, "top_p": 0.9, "top_k": 5, "max_new_tokens": 12,
                                     "stop": None, "stop_token_ids": None, "skip_special_tokens": False,
                                     "no_stop_trim": True, "spaces_between_special_tokens": False}
    assert asyncio.run(_semaphore_value(state)) == 3
    SingletonMeta.clear_instances(GenerateState)


async def _semaphore_value(state: GenerateState) -> int:
    return state.semaphore._value


# ---- rm_hub --------------------------------------------------------------------------------------
def _rm_args(**kw) -> Namespace:
    return Namespace(**{"custom_rm_path": None, "rm_type": None, "rm_url": None, **kw})


def test_async_rm_follows_slimes_order() -> None:
    boxed = Sample(prompt="p", response="</think> so \\boxed{4}", label="4")
    assert asyncio.run(async_rm(_rm_args(rm_type="deepscaler"), boxed)) == 1
    boxed.metadata["rm_type"] = "math"  # the sample's type wins over --rm-type
    assert asyncio.run(async_rm(_rm_args(rm_type="f1"), boxed)) == 1
    assert asyncio.run(async_rm(_rm_args(custom_rm_path=f"{PLUGINS}.one_rm", rm_type="math"), boxed)) == 42.0
    boxed.custom_rm_path = f"{PLUGINS}.one_rm"  # an eval set's own RM wins over everything
    assert asyncio.run(async_rm(_rm_args(rm_type="math"), boxed)) == 42.0
    samples = [Sample(prompt="p", response="x" * n, label="1") for n in (1, 3)]
    assert asyncio.run(batched_async_rm(_rm_args(custom_rm_path=f"{PLUGINS}.batch_rm"), samples)) == [1.0, 3.0]
    assert asyncio.run(batched_async_rm(_rm_args(rm_type="f1"), samples)) == [0.0, 0.0]
    assert grade_answer_verl("so \\boxed{\\frac{1}{2}}", "0.5")


@pytest.mark.parametrize("solution, truth, strict, expected", [
    ("...\nAnswer: 42", "42", False, {"score": 1.0, "acc": True, "pred": "42"}),
    ("...\nAnswer: 41", "42", False, {"score": -1.0, "acc": False, "pred": "41"}),
    ("so Answer: \\boxed{42}", "42", True, {"score": 1.0, "acc": True, "pred": "42"}),
    ("so Answer: \\boxed{42.0}", "42", True, {"score": -1.0, "acc": False, "pred": "42.0"}),  # verbatim
    ("no box at all", "42", True, {"score": -1.0, "acc": False, "pred": None}),
])
def test_math_dapo_compute_score_as_slimes(solution: str, truth: str, strict: bool, expected: dict) -> None:
    assert compute_score(solution, truth, strict_box_verify=strict) == expected


def test_random_and_ifbench_rewards(monkeypatch: pytest.MonkeyPatch) -> None:
    from rollout.ifbench import missing_evaluation_lib
    from rollout.rewards import rule_based_reward

    draws = [rule_based_reward("random", f"response {i}", "x", {}) for i in range(64)]
    assert set(draws) == {0, 1} and 16 < sum(draws) < 48  # slime's random.randint(0, 1), from a hash
    assert draws == [rule_based_reward("random", f"response {i}", "x", {}) for i in range(64)]  # resumable
    monkeypatch.delitem(sys.modules, "evaluation_lib", raising=False)
    assert "git clone https://github.com/allenai/IFBench" in (missing_evaluation_lib() or "")
    monkeypatch.syspath_prepend(str(IFBENCH_STANDIN))
    assert missing_evaluation_lib() is None
    metadata = {"instruction_id_list": ["ends_with"], "kwargs": [{"end": "done.", "unused": None}],
                "prompt_text": "say done", "record_id": 3}
    assert rule_based_reward("ifbench", "all done.", None, metadata) == 1.0
    assert rule_based_reward("ifbench", "not finished", None, metadata) == 0.0
    assert rule_based_reward("ifbench", "all done.", None, {}) == 0.0  # no instructions: slime's 0


def test_an_eval_sets_own_functions_win_over_the_flags(model: Path, tmp_path: Path) -> None:
    """--eval-config's per-set custom_rm_path and custom_generate_function_path reach its samples and
    are used for them, as slime's eval rollout uses them."""
    from rollout.eval_sets import EvalSet

    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"input": f"repeat: {i + 1}", "label": str(i + 1)}) + "\n" for i in range(2)))
    eval_set = EvalSet(name="s", path=str(data), input_key="input", label_key="label", metadata_key=None,
                       n_samples_per_eval_prompt=2, temperature=1.0, top_p=1.0, top_k=-1, max_response_len=4,
                       custom_rm_path=f"{PLUGINS}.one_rm",
                       custom_generate_function_path=f"{PLUGINS}.generate_with_evaluation")
    buffer = DataBuffer(JsonlDataSource(data, label_key="label", n_samples_per_prompt=2, shuffle=False,
                                        stamp=eval_set.stamp))
    args = RolloutArgs(hf_checkpoint=str(model), router_url="http://127.0.0.1:1", rollout_batch_size=2,
                       n_samples_per_prompt=2, rm_type="toy")
    samples = [s for g in generate_rollout(args, 0, buffer, evaluation=True) for s in g]
    assert [s.reward for s in samples] == [42.0] * 4 and all(s.metadata["evaluation"] for s in samples)
