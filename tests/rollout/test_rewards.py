"""The built-in rewards slime's --rm-type names: math, deepscaler, dapo, f1, gpqa, the boxed_
prefix, a sample's own rm_type. Every expected value in the math, deepscaler and dapo tables is
what slime's own rm_hub code (math_utils, deepscaler, math_dapo_utils) returns for that input."""

from __future__ import annotations

import pytest

from rollout.rewards import f1_reward, gpqa_reward, math_reward, rule_based_reward


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
    with pytest.raises(ValueError, match="rm_type 'nope': not a built-in reward"):
        rule_based_reward("nope", "x", "y", {})
    with pytest.raises(ValueError, match="no reward type: give --rm-type"):
        rule_based_reward(None, "x", "y", {})
    # slime's boxed_ extraction: the last \\boxed{}, none from an \\fbox
    assert rule_based_reward("boxed_dapo", "\\boxed{Answer: 7}", "7", {})["score"] == 1.0
    assert rule_based_reward("boxed_f1", "\\fbox{blue whale}", "blue whale", {}) == 0.0


MATH = [  # (response, label, slime's reward)
    ("so \\boxed{42}.", "42", 1),
    ("\\boxed{41}", "42", 0),  # wrong
    ("no answer here", "42", 0),  # no answer
    ("Answer: 42", "42", 0),  # math reads only a \boxed{}
    ("\\boxed{\\dfrac{1}{2}}", "\\frac{1}{2}", 1),  # \dfrac
    ("\\boxed{0.5}", "\\frac{1}{2}", 1),  # 0.5 is \frac{1}{2}
    ("\\boxed{1/2}", "\\frac12", 1),  # a/b and \frac12
    ("\\boxed{2/4}", "\\frac{1}{2}", 0),  # an unreduced fraction is wrong
    ("\\boxed{10\\%}", "10", 1),  # percent
    ("\\boxed{5 \\text{ cm}}", "5", 1),  # a unit on the right
    ("\\boxed{5 \\text{ cm} \\text{ m}}", "5", 0),  # two units: left unnormalised
    ("\\boxed{90^\\circ}", "90", 1),  # degrees
    ("\\boxed{x = 3}", "3", 1),  # "x = " dropped
    ("\\boxed{\\sqrt2}", "\\sqrt{2}", 1),
    ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}", 1),  # equal under sympy
    ("\\boxed{x^2+2x+1}", "(x+1)^2", 1),
    ("\\boxed{\\pi}", "\\pi", 1),
    ("\\boxed{(1, 2)}", "(1,2)", 1),  # tuples element by element
    ("\\boxed{[1, 2]}", "(1,2)", 0),  # ...with the same brackets
    ("\\boxed{\\left( 1,2 \\right)}", "(1,2)", 1),
    ("\\boxed{1,000}", "1000", 1),  # thousands separator
    ("\\boxed{3.0}", "3", 1),
    ("\\boxed{7 3/4}", "31/4", 1),  # mixed number
    ("\\boxed{2 million}", "2000000", 0),
    ("\\boxed{\\text{Monday}}", "monday", 1),  # \text{}, case
    ("\\boxed{1}", "\\boxed{1}", 1),  # a boxed label
    ("\\boxed{1}", "\\boxed{1", 0),  # an unbalanced boxed label
    ("\\boxed{1", "1", 0),  # an unbalanced box
    ("\\fbox{1}", "1", 0),
    ("\\boxed{0}", 0, 0),  # a falsy label is never matched
    ("\\boxed{3}", 3, 1),  # a number label
    ("\\boxed{\\frac}", "\\frac", 1),  # a rewrite that fails leaves the answer as it is
]


@pytest.mark.parametrize(("response", "label", "reward"), MATH)
def test_math_grades_as_slime(response: str, label, reward: int) -> None:
    assert math_reward(response, label) == reward
    assert rule_based_reward("math", response, label, {}) == reward


DEEPSCALER = [  # (response, label, slime's reward)
    ("<think>hmm \\boxed{3}</think> so \\boxed{42}", "42", 1),  # the answer after </think>
    ("<think>\\boxed{42}</think> no box after", "42", 0),  # a box inside the thinking does not count
    ("\\boxed{42}", "42", 0),  # no </think> and no ###Response
    ("###Response the answer is \\boxed{42}", "42", 1),
    ("<think>a</think>x</think> \\boxed{42}", "42", 1),  # after the last </think>
    ("<think>x</think> \\boxed{42}", "", 0),  # an empty label
    ("<think>x</think> \\boxed{42}", "\\boxed{42}", 1),
    ("<think>x</think> \\boxed{42}", "\\boxed{42", 0),
    ("<think>x</think> \\boxed{1/2}", "\\frac{1}{2}", 1),
    ("<think>x</think> \\boxed{0.5}", 0.5, 1),
    ("<think>x</think> \\boxed{12}", 12, 1),
    ("<think>x</think> \\boxed{2/4}", "1/2", 0),
    ("<think>x</think> \\boxed{\\$5}", "5", 1),
    ("<think>x</think> \\boxed{41}", "42", 0),
]


@pytest.mark.parametrize(("response", "label", "reward"), DEEPSCALER)
def test_deepscaler_grades_as_slime(response: str, label, reward: int) -> None:
    assert rule_based_reward("deepscaler", response, label, {}) == reward


DAPO = [  # (response, label, slime's score, slime's pred)
    ("reasoning\nAnswer: 42", "42", 1.0, "42"),
    ("Answer: 41", "42", -1.0, "41"),
    ("no answer", "42", -1.0, "[INVALID]"),
    ("answer : $1,000$", "1000", 1.0, "1000"),  # case, $...$, thousands separator
    ("Answer: \\boxed{7}", "7", 1.0, "7"),
    ("Answer: x = 12 degrees", "12", 1.0, "12"),  # after "=", units removed
    ("Answer: 12 students", "12", 1.0, "12"),
    ("Answer: \\text{9}", "9", 1.0, "9"),
    ("Answer: 3\nthen Answer: 4", "4", 1.0, "4"),  # the last answer line
    ("Answer: 5" + "x" * 300, "5", -1.0, "[INVALID]"),  # only the last 300 characters are read
    ("x" * 400 + "\nAnswer: 5", "5.0", 1.0, "5"),  # the label as an integer
]


@pytest.mark.parametrize(("response", "label", "score", "pred"), DAPO)
def test_dapo_grades_as_slime(response: str, label, score: float, pred: str) -> None:
    assert rule_based_reward("dapo", response, label, {}) == {"score": score, "acc": score == 1.0, "pred": pred}


def test_dapo_refuses_a_label_that_is_not_a_number() -> None:
    with pytest.raises(ValueError, match="label 'x' is not a number"):
        rule_based_reward("dapo", "Answer: x", "x", {})
