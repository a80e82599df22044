"""Built-in rewards: a math answer checker and the toy task's reward."""

from __future__ import annotations

import re

_ANSWER_LINE = re.compile(r"^\s*answer\s*[:：]\s*(.+?)\s*$", re.IGNORECASE | re.MULTILINE)


def last_boxed(text: str) -> str | None:
    """The contents of the last \\boxed{...} (braces balanced), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1: j]
    return None


def extract_answer(response: str) -> str | None:
    """\\boxed{...} wins; else the last "Answer: ..." line."""
    boxed = last_boxed(response)
    if boxed is not None:
        return boxed
    lines = _ANSWER_LINE.findall(response)
    return lines[-1] if lines else None


def _normalise(answer: str) -> str:
    answer = answer.strip().strip("$").rstrip(".").replace(" ", "").replace("\\!", "")
    answer = re.sub(r"\\(?:text|mathrm)\{([^}]*)\}", r"\1", answer)
    return answer.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")


def math_reward(response: str, label: str | int | float) -> float:
    """1.0 if the extracted answer equals the label (numerically when both are numbers), else 0.0."""
    answer = extract_answer(response)
    if answer is None:
        return 0.0
    got, want = _normalise(answer), _normalise(str(label))
    if got == want:
        return 1.0
    try:
        return float(abs(float(got.replace(",", "")) - float(want.replace(",", ""))) < 1e-6)
    except ValueError:
        return 0.0


def toy_reward(response: str, label: str) -> float:
    """The toy task (repeat the digit): 1.0 if the response's first non-space character is the label."""
    stripped = response.strip()
    return float(bool(stripped) and stripped[0] == str(label))
