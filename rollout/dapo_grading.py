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
    return compute_score(response, label)


def compute_score(solution_str: str, ground_truth: Any, strict_box_verify: bool = False,
                  pause_tokens_index: list[int] | None = None) -> dict[str, Any]:
    """slime's math_dapo_utils.compute_score: the Minerva check of the last 300 characters, or with
    strict_box_verify (retool's reward) the last \\boxed{...} of the last 100 characters (after
    the last pause token, given its 4 indices) compared verbatim with the label."""
    solution_str = solution_str[-300:]  # the longest answer in MATH-500 has 159 characters
    if strict_box_verify:
        correct, pred = _strict_box(solution_str, ground_truth, pause_tokens_index)
    else:
        correct, pred = _minerva(solution_str, ground_truth)
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred}


def _minerva(solution: str, label: Any) -> tuple[bool, str]:
    matches = _ANSWER.findall(solution)
    pred = normalize_final_answer(matches[-1] if matches else "[INVALID]")
    truth = normalize_final_answer(label)
    try:
        truth = str(int(float(truth)))
    except (ValueError, OverflowError):
        raise ValueError(f"dapo reward: label {label!r} is not a number (DAPO's answers are integers); "
                         "use --rm-type math or deepscaler for other answers") from None
    return pred == truth, pred


def last_boxed_only_string(text: str) -> str | None:
    """The last \\boxed{...} of text, braces balanced, or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth = 0
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if text[i] == "}" and depth == 0:
            return text[start:i + 1]
    return None


def _strict_box(pred: str, truth: Any, pause_tokens_index: list[int] | None) -> tuple[bool, str | None]:
    if pause_tokens_index is not None:
        if len(pause_tokens_index) != 4:
            raise ValueError(f"pause_tokens_index: give the 4 pause tokens' indices, got {pause_tokens_index}")
        pred = pred[pause_tokens_index[-1] - 100:]
    else:
        pred = pred[-100:]
    boxed = last_boxed_only_string(pred)  # compared with the label as it is, as slime compares it
    answer = boxed[len("\\boxed{"):-1] if boxed is not None else None
    return answer == truth, answer
