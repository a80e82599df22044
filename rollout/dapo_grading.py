"""--rm-type dapo: slime's rm_hub/math_dapo_utils.compute_score (DAPO's Minerva-style check,
after lm-evaluation-harness), ported so every answer grades exactly as slime grades it.

The reward is a dict, {"score": 1.0 or -1.0, "acc": bool, "pred": the normalised answer}, so
--reward-key (slime's recipes use "score") picks what is trained on.
"""

from __future__ import annotations

import re
from typing import Any

_SUBSTITUTIONS = (("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), (r"\ ", ""), (" ", ""), ("mbox", "text"),
                  (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"))
_REMOVED_EXPRESSIONS = (
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue", "points",
    "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals", "edges", "students",
    "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}", "\\text{}^2", "\\text{}^3", "\\text{\n}",
    "\\text{}", r"\mathrm{th}", r"^\circ", r"^{\circ}", r"\;", r",\!", "{,}", '"', "\\dots", "<|im_end|>",
    "<|endoftext|>")
_ANSWER = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")


def normalize_final_answer(final_answer: str) -> str:
    final_answer = str(final_answer).split("=")[-1]
    for before, after in _SUBSTITUTIONS:
        final_answer = final_answer.replace(before, after)
    for expr in _REMOVED_EXPRESSIONS:
        final_answer = final_answer.replace(expr, "")
    # keep the math between the first pair of $...$, and unwrap \text, \textbf, \overline, \boxed
    final_answer = re.sub(r"(.*?)(\$)(.*?)(\$)(.*)", "$\\3$", final_answer)
    final_answer = re.sub(r"(\\text\{)(.*?)(\})", "\\2", final_answer)
    final_answer = re.sub(r"(\\textbf\{)(.*?)(\})", "\\2", final_answer)
    final_answer = re.sub(r"(\\overline\{)(.*?)(\})", "\\2", final_answer)
    final_answer = re.sub(r"(\\boxed\{)(.*)(\})", "\\2", final_answer)
    # shorthand TeX: \fracab -> \frac{a}{b}, \sqrta -> \sqrt{a}
    final_answer = re.sub(r"(frac)([^{])(.)", "frac{\\2}{\\3}", final_answer)
    final_answer = re.sub(r"(sqrt)([^{])", "sqrt{\\2}", final_answer)
    final_answer = final_answer.replace("$", "")
    if final_answer.replace(",", "").isdigit():
        final_answer = final_answer.replace(",", "")
    return final_answer.strip()


def dapo_reward(response: str, label: Any) -> dict[str, Any]:
    """The last "Answer: ..." line of the response's last 300 characters, normalised, against the
    label as an integer (DAPO's answers all are)."""
    matches = _ANSWER.findall(response[-300:])
    pred = normalize_final_answer(matches[-1] if matches else "[INVALID]")
    truth = normalize_final_answer(label)
    try:
        truth = str(int(float(truth)))
    except (ValueError, OverflowError):
        raise ValueError(f"dapo reward: label {label!r} is not a number (DAPO's answers are integers); "
                         "use --rm-type math or deepscaler for other answers") from None
    correct = pred == truth
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred}
