"""Built-in rewards (--rm-type, or a sample's metadata["rm_type"], as slime reads them): math, f1,
gpqa and the toy task's; a `boxed_` prefix scores only the last \\boxed{...} of the response."""

from __future__ import annotations

import re
import string
from collections import Counter
from typing import Any

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


# ---- f1: the HotpotQA token F1 slime's "f1" uses ------------------------------------------------
def _qa_normalise(text: str) -> str:
    text = "".join(c for c in str(text).lower() if c not in string.punctuation)
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", text).split())


def f1_reward(response: str, label: Any) -> float:
    """Token F1 of the normalised response against the label; a yes/no/noanswer on either side
    scores only an exact match."""
    got, want = _qa_normalise(response), _qa_normalise(label)
    if (got in ("yes", "no", "noanswer") or want in ("yes", "no", "noanswer")) and got != want:
        return 0.0
    common = sum((Counter(got.split()) & Counter(want.split())).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(got.split()), common / len(want.split())
    return 2 * precision * recall / (precision + recall)


# ---- gpqa: multiple choice, by letter or by the choice's text -------------------------------
_LETTER_PATTERNS = (r"(?:answer|option|choice)\s*(?:is|:)?\s*([A-Z])\b", r"\b([A-Z])\s*is\s*(?:the\s*)?correct",
                    r"final\s*(?:answer|option)\s*(?:is|:)?\s*([A-Z])\b")


def _after_thinking(text: str) -> str:
    return text.rsplit("</think>", 1)[-1]


def _chosen_letter(response: str, letters: list[str]) -> str | None:
    text = _after_thinking(response)
    for pattern in _LETTER_PATTERNS:
        match = re.search(pattern, text, flags=re.IGNORECASE)
        if match and match.group(1).upper() in letters:
            return match.group(1).upper()
    standalone = [c for c in re.findall(r"\b([A-Z])\b", text) if c in letters]
    return standalone[-1] if standalone else None


def gpqa_reward(response: str, label: Any, metadata: dict[str, Any]) -> float:
    """1.0 if the response picks the right option. The right one is metadata["correct_letter"], a
    one-letter label, an index label, or the choice (metadata["choices"]) whose text is the label;
    without a letter in the response, the right choice's text appearing in it counts."""
    choices = metadata.get("choices")
    choices = list(choices.values()) if isinstance(choices, dict) else list(choices or [])
    letters = ([str(c).upper() for c in metadata["valid_letters"]] if metadata.get("valid_letters")
               else list(string.ascii_uppercase[:len(choices) or 10]))
    right = str(metadata.get("correct_letter") or "").strip().upper() or None
    text = str(label).strip() if isinstance(label, str) else None
    if right is None and isinstance(label, (int, float)) and 0 <= int(label) < len(letters):
        right = letters[int(label)]
    if right is None and text and text.upper() in letters:
        right = text.upper()
    if right is None and text:
        right = next((letters[k] for k, c in enumerate(choices) if _qa_normalise(c) == _qa_normalise(text)), None)
    chosen = _chosen_letter(response, letters)
    if chosen and right:
        return float(chosen == right)
    targets = [str(choices[letters.index(right)])] if right and letters.index(right) < len(choices) else []
    targets += [str(metadata[k]) for k in ("correct_answer", "answer_text") if metadata.get(k)]
    targets += [text] if text and text.upper() not in letters else []
    said = f" {_qa_normalise(_after_thinking(response))} "
    return float(any(_qa_normalise(t) and f" {_qa_normalise(t)} " in said for t in targets))


REWARD_TYPES = ("math", "toy", "f1", "gpqa")  # each also with the boxed_ prefix


def rule_based_reward(rm_type: str, response: str, label: Any, metadata: dict[str, Any]) -> float:
    """The reward of one response by a built-in type; ValueError naming an unknown type."""
    rm_type = str(metadata.get("rm_type") or rm_type).strip()
    if rm_type.startswith("boxed_"):
        response, rm_type = last_boxed(response) or "", rm_type.removeprefix("boxed_")
    if rm_type == "math":
        return math_reward(response, label)
    if rm_type == "toy":
        return toy_reward(response, label)
    if rm_type == "f1":
        return f1_reward(response, label)
    if rm_type == "gpqa":
        return gpqa_reward(response, label, metadata)
    raise ValueError(f"rm_type {rm_type!r}: not a built-in reward; one of {', '.join(REWARD_TYPES)} "
                     "(each may take a boxed_ prefix), or give --custom-rm-path")
