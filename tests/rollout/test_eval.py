"""Eval's flags and numbers: the sets of --eval-prompt-data with their sampling parameters, and
slime's metrics (mean reward, truncated ratio, pass@k by the unbiased estimator)."""

from __future__ import annotations

import argparse
from math import comb
from pathlib import Path

import pytest

from rollout.eval import eval_metrics, pass_at_k
from rollout.eval_sets import EvalConfigError, eval_sets


def _args(**kw) -> argparse.Namespace:
    base = dict(eval_prompt_data=None, eval_input_key=None, eval_label_key=None, input_key="input", label_key="label",
                metadata_key="metadata", n_samples_per_eval_prompt=1, eval_temperature=None, rollout_temperature=1.0,
                eval_top_p=None, rollout_top_p=0.9, eval_top_k=None, rollout_top_k=-1, eval_max_response_len=None,
                rollout_max_response_len=64)
    return argparse.Namespace(**{**base, **kw})


def test_sets_in_the_given_order_with_eval_flags_over_rollout_ones(tmp_path: Path) -> None:
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text('{"q": "x"}\n'), b.write_text('{"q": "y"}\n')
    sets = eval_sets(_args(eval_prompt_data=["math", str(a), "code", str(b)], eval_input_key="q",
                           eval_temperature=0.0, eval_max_response_len=8, n_samples_per_eval_prompt=4))
    assert [(s.name, s.path) for s in sets] == [("math", str(a)), ("code", str(b))]
    assert (sets[0].input_key, sets[0].label_key, sets[0].temperature, sets[0].top_p, sets[0].top_k,
            sets[0].max_response_len, sets[0].n_samples_per_eval_prompt) == ("q", "label", 0.0, 0.9, -1, 8, 4)
    assert eval_sets(_args(eval_prompt_data=[str(a)]))[0].name == "aime"  # slime's legacy single path


@pytest.mark.parametrize(("values", "message"), [
    (["math"], "no such file"), (["math", "a.jsonl", "code"], "NAME PATH pairs"),
    (["math", "a.jsonl", "math", "a.jsonl"], "its own name"), (["math", "nope.jsonl"], "nope.jsonl: no such file"),
])
def test_bad_eval_prompt_data_names_the_flag(tmp_path: Path, monkeypatch, values: list[str], message: str) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.jsonl").write_text('{"input": "x"}\n')
    with pytest.raises(EvalConfigError, match=message):
        eval_sets(_args(eval_prompt_data=values))


def test_pass_at_k_is_the_unbiased_estimate_averaged_over_prompts() -> None:
    rewards = [1, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1]  # 4 prompts x 4: 1, 2, 0 and 4 correct
    got = pass_at_k(rewards, [i // 4 for i in range(16)])
    for k in (1, 2, 4):
        want = sum(1 - comb(4 - c, k) / comb(4, k) for c in (1, 2, 0, 4)) / 4
        assert got[f"pass@{k}"] == pytest.approx(want)
    assert set(got) == {"pass@1", "pass@2", "pass@4"} and pass_at_k([1, 0], [0, 1]) == {}
    assert pass_at_k([0.5, 1, 1, 1], [0, 0, 1, 1])["pass@1"] == pytest.approx(0.75)  # only reward 1 passes


def test_eval_metrics_use_slimes_names() -> None:
    data = {"toy": {"rewards": [1.0, 0.0, 1.0, None], "truncated": [False, True, False, False]}}
    got = eval_metrics(data, 2)
    assert got["eval/toy"] == 0.5 and got["eval/toy-truncated_ratio"] == 0.25
    assert got["eval/toy-pass@1"] == pytest.approx(0.5) and got["eval/toy-pass@2"] == pytest.approx(1.0)
