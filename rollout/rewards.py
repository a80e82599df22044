"""Built-in rewards (--rm-type, or a sample's metadata["rm_type"], as slime reads them): math,
deepscaler, dapo, f1, gpqa, ifbench (rollout.ifbench), random and the toy task's; a `boxed_`
prefix scores only the last \\boxed{...} of the response. remote_rm (a reward server at --rm-url)
is rollout.remote_rm's."""

from __future__ import annotations

import hashlib
import re
import string
from collections import Counter
from typing import Any

from rollout.dapo_grading import dapo_reward
from rollout.ifbench import ifbench_reward
from rollout.math_grading import deepscaler_reward, extract_answer, grade_answer_verl


def math_reward(response: str, label: Any) -> int:
    """slime's math: 1 if the response's last \\boxed{} answer equals the label (as MATH's
    normaliser or sympy sees it), else 0."""
    return int(grade_answer_verl(response, label))


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


def random_reward(response: str, label: Any) -> int:
    """slime's "random": 0 or 1, each half the time (a test of the pipeline, not of the model).
    Drawn from a hash of the response and label, not from a global RNG, so a resumed run scores a
    regenerated rollout as the uninterrupted run did."""
    return hashlib.sha256(f"{response}\0{label}".encode()).digest()[0] & 1


REMOTE = "remote_rm"
# each also with the boxed_ prefix
REWARD_TYPES = ("math", "deepscaler", "dapo", "f1", "gpqa", "ifbench", "random", "toy", REMOTE)
DICT_REWARDS = {"dapo": ("score", "acc", "pred")}  # types whose reward is a dict: --reward-key picks one


def sample_type(rm_type: str | None, metadata: dict[str, Any]) -> str:
    """The type a sample is scored by: its metadata's rm_type over --rm-type (slime's order)."""
    return str(metadata.get("rm_type") or rm_type or "").strip()


def rule_based_reward(rm_type: str | None, response: str, label: Any, metadata: dict[str, Any]) -> Any:
    """The reward of one response by a built-in type (a number, or dapo's dict); ValueError
    naming a missing or unknown type."""
    rm_type = sample_type(rm_type, metadata)
    if rm_type.startswith("boxed_"):
        response, rm_type = extract_answer(response) or "", rm_type.removeprefix("boxed_")
    if rm_type == "math":
        return math_reward(response, label)
    if rm_type == "deepscaler":
        return deepscaler_reward(response, label)
    if rm_type == "dapo":
        return dapo_reward(response, label)
    if rm_type == "toy":
        return toy_reward(response, label)
    if rm_type == "f1":
        return f1_reward(response, label)
    if rm_type == "gpqa":
        return gpqa_reward(response, label, metadata)
    if rm_type == "ifbench":
        return ifbench_reward(response, label, metadata)
    if rm_type == "random":
        return random_reward(response, label)
    known = f"one of {', '.join(REWARD_TYPES)} (each may take a boxed_ prefix), or give --custom-rm-path"
    if not rm_type:
        raise ValueError(f"no reward type: give --rm-type, {known}")
    if rm_type == REMOTE:
        raise ValueError("rm_type remote_rm is scored by a reward server: give --rm-url")
    raise ValueError(f"rm_type {rm_type!r}: not a built-in reward; {known}")
