"""The built-in rewards slime's --rm-type names: f1, gpqa, the boxed_ prefix, a sample's own rm_type."""

from __future__ import annotations

import pytest

from rollout.rewards import f1_reward, gpqa_reward, rule_based_reward


def test_f1_is_token_overlap_after_normalising() -> None:
    assert f1_reward("The Eiffel Tower!", "eiffel tower") == 1.0
    assert f1_reward("Paris, France", "paris") == pytest.approx(2 * 0.5 * 1.0 / 1.5)
    assert f1_reward("no", "yes") == 0.0 and f1_reward("yes", "Yes.") == 1.0
    assert f1_reward("", "anything") == 0.0


@pytest.mark.parametrize(("response", "label", "metadata", "reward"), [
    ("Reasoning... The answer is C.", "C", {}, 1.0),
    ("<think>maybe A</think> Final answer: B", "C", {}, 0.0),
    ("I pick option B", 1, {"choices": ["red", "green", "blue"]}, 1.0),
    ("I pick option B", "green", {"choices": ["red", "green", "blue"]}, 1.0),
    ("it must be blue", "blue", {"choices": ["red", "green", "blue"]}, 1.0),
    ("The answer is A", "x", {"correct_letter": "a"}, 1.0),
])
def test_gpqa_by_letter_index_or_choice_text(response: str, label, metadata: dict, reward: float) -> None:
    assert gpqa_reward(response, label, metadata) == reward


def test_boxed_prefix_and_a_samples_own_type() -> None:
    assert rule_based_reward("boxed_f1", "words \\boxed{blue whale} more", "blue whale", {}) == 1.0
    assert rule_based_reward("math", "Paris", "paris", {"rm_type": "f1"}) == 1.0
    with pytest.raises(ValueError, match="rm_type 'dapo': not a built-in reward"):
        rule_based_reward("dapo", "x", "y", {})
