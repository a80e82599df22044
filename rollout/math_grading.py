"""slime's math answer grading (its rm_hub/math_utils.py, from DeepScaleR, after Hendrycks' MATH
code): `grade_answer_verl` is --rm-type math, `deepscaler_reward` is --rm-type deepscaler.

Ported step by step so every answer grades exactly as slime grades it; the order of the string
rewrites matters and is kept.
"""

from __future__ import annotations

import re
from typing import Any

# sympy can hang on these; such answers are compared as strings only
_BAD_SUBSTRINGS = ("^{", "^(")
_BAD_REGEXES = (r"\^[0-9]+\^", r"\^[0-9][0-9]+")
_TUPLE_CHARS = "()[]"
_UNITS = ("degree", "cm", "centimeter", "meter", "mile", "second", "minute", "hour", "day", "week", "month", "year",
          "foot", "feet", "inch", "yard")


# ---- Hendrycks' MATH normalisation ("mathd") ---------------------------------------------------
def _fix_fracs(s: str) -> str:
    """\\frac12 -> \\frac{1}{2}, \\frac1{72} -> \\frac{1}{72}."""
    parts = s.split("\\frac")
    out = parts[0]
    for part in parts[1:]:
        out += "\\frac"
        if part[0] == "{":  # (an empty part raises: the answer is then left unnormalised, as in slime)
            out += part
            continue
        if len(part) < 2:
            return s
        a, b, rest = part[0], part[1], part[2:]
        out += "{" + a + "}{" + b + "}" + rest if b != "{" else "{" + a + "}" + b + rest
    return out


def _fix_a_slash_b(s: str) -> str:
    if len(s.split("/")) != 2:
        return s
    a, b = s.split("/")
    try:
        a_int, b_int = int(a), int(b)
    except ValueError:
        return s
    return "\\frac{" + str(a_int) + "}{" + str(b_int) + "}" if s == f"{a_int}/{b_int}" else s


def _remove_right_units(s: str) -> str:
    # "\text{ " only ever introduces units (in the MATH validation set)
    if "\\text{ " not in s:
        return s
    splits = s.split("\\text{ ")
    if len(splits) != 2:
        raise ValueError("more than one unit")  # slime asserts: the answer is then left unnormalised
    return splits[0]


def _fix_sqrt(s: str) -> str:
    if "\\sqrt" not in s:
        return s
    splits = s.split("\\sqrt")
    out = splits[0]
    for split in splits[1:]:
        out += "\\sqrt" + split if split[:1] == "{" else "\\sqrt{" + split[0] + "}" + split[1:]
    return out


def _strip_string(s: str) -> str:
    s = s.replace("\n", "").replace("\\!", "").replace("\\\\", "\\")
    s = s.replace("tfrac", "frac").replace("dfrac", "frac")
    s = s.replace("\\left", "").replace("\\right", "")
    s = s.replace("^{\\circ}", "").replace("^\\circ", "")
    s = s.replace("\\$", "")
    s = _remove_right_units(s)
    s = s.replace("\\%", "")
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    if not s:
        return s
    if s[0] == ".":
        s = "0" + s
    if len(s.split("=")) == 2 and len(s.split("=")[0]) <= 2:  # "k = 3" -> "3"
        s = s.split("=")[1]
    s = _fix_sqrt(s)
    s = s.replace(" ", "")
    s = _fix_fracs(s)
    if s == "0.5":
        s = "\\frac{1}{2}"
    return _fix_a_slash_b(s)


def mathd_normalize_answer(answer: str | None) -> str | None:
    if answer is None:
        return None
    answer = answer.strip()
    try:
        if m := re.search(r"^\\text\{(?P<text>.+?)\}$", answer):
            answer = m.group("text").strip()
        return _strip_string(answer)
    except Exception:  # slime's: an answer the rewrites trip on is compared as it is
        return answer


def grade_answer_mathd(given: str, ground_truth: str) -> bool:
    return mathd_normalize_answer(ground_truth) == mathd_normalize_answer(given)


# ---- sympy equivalence ------------------------------------------------------------------------
# sympy and pylatexenc are imported on first use: the job's command line reads the reward types
# (trainer.args) and must start fast.
def _sympy_parse(expr: str) -> Any:
    import sympy
    from sympy.parsing import sympy_parser

    names = {k: v for k, v in sympy.__dict__.items() if not k.startswith("_")}
    return sympy_parser.parse_expr(
        expr.replace("^", "**"), local_dict={}, global_dict={"__builtins__": {}, **names},
        transformations=sympy_parser.standard_transformations + (sympy_parser.implicit_multiplication_application,))


def _parse_latex(expr: str) -> str:
    from pylatexenc import latex2text

    expr = expr.replace("\\tfrac", "\\frac").replace("\\dfrac", "\\frac").replace("\\frac", " \\frac")
    expr = latex2text.LatexNodes2Text().latex_to_text(expr)
    for symbol, name in (("√", "sqrt"), ("π", "pi"), ("∞", "inf"), ("∪", "U"), ("·", "*"), ("×", "*")):
        expr = expr.replace(symbol, name)
    return expr.strip()


def _is_float(s: str) -> bool:
    try:
        float(s)
        return True
    except ValueError:
        return False


def _is_int(x: float) -> bool:
    try:
        return abs(x - int(round(x))) <= 1e-7
    except (OverflowError, ValueError):
        return False


def _is_frac(expr: str) -> bool:
    return bool(re.search(r"^-?[0-9]+.?/0*[1-9][0-9]*.?$", expr))


def _strip_properly_formatted_commas(expr: str) -> str:
    pattern = re.compile(r"(\d)(,)(\d\d\d)($|\D)")  # 1,000 but not the comma of a tuple
    while (next_expr := pattern.sub("\\1\\3\\4", expr)) != expr:
        expr = next_expr
    return expr


def _str_is_int(s: str) -> bool:
    try:
        return _is_int(float(_strip_properly_formatted_commas(s)))
    except ValueError:
        return False


def _normalize(expr: str) -> str:
    if m := re.search(r"^\\text\{(?P<text>.+?)\}$", expr):
        expr = m.group("text")
    expr = expr.replace("\\%", "%").replace("\\$", "$").replace("$", "").replace("%", "")
    expr = expr.replace(" or ", " , ").replace(" and ", " , ")
    expr = expr.replace("million", "*10^6").replace("billion", "*10^9").replace("trillion", "*10^12")
    for unit in _UNITS:
        expr = re.sub(rf"{unit}(es)?(s)? *(\^[0-9]+)?", "", expr)
    expr = re.sub(r"\^ *\\circ", "", expr)
    if expr and expr[0] == "{" and expr[-1] == "}":
        expr = expr[1:-1]
    expr = re.sub(",\\\\! *", "", expr)
    if _is_float(expr) and _is_int(float(expr)):
        expr = str(int(round(float(expr))))
    if "\\" in expr:
        try:
            expr = _parse_latex(expr)
        except Exception:  # slime's: LaTeX pylatexenc cannot read stays as it is
            pass
    expr = re.sub("- *", "-", expr)
    expr = re.sub("([0-9]) +([0-9])", "\\1+\\2", expr)  # a mixed number: 7 3/4 -> 7+3/4
    expr = expr.replace(" ", "").replace("{", "").replace("}", "").lower()
    if _str_is_int(expr):
        expr = str(int(float(expr.replace(",", ""))))
    return expr


def _should_allow_eval(expr: str) -> bool:
    letters = {c for c in expr.replace("sqrt", "").replace("frac", "") if c.isalpha()}
    return (len(letters) <= 2 and not any(bad in expr for bad in _BAD_SUBSTRINGS)
            and not any(re.search(bad, expr) for bad in _BAD_REGEXES))


def _equal_under_sympy(ground_truth: str, given: str) -> bool:
    import sympy

    expr = f"({ground_truth})-({given})"
    try:
        return _should_allow_eval(expr) and sympy.simplify(_sympy_parse(expr)) == 0
    except Exception:  # slime's: anything sympy cannot parse or simplify is not equal
        return False


def _split_tuple(expr: str) -> list[str]:
    expr = _strip_properly_formatted_commas(expr)
    if not expr:
        return []
    if (len(expr) > 2 and expr[0] in _TUPLE_CHARS and expr[-1] in _TUPLE_CHARS
            and all(ch not in expr[1:-1] for ch in _TUPLE_CHARS)):
        return [elem.strip() for elem in expr[1:-1].split(",")]
    return [expr]


def grade_answer_sympy(given: str, ground_truth: str | None) -> bool:
    if ground_truth is None:  # a label whose \\boxed{} is unbalanced
        return False
    truth, got = _normalize(ground_truth), _normalize(given)
    if truth == got:
        return True
    if not got:
        return False
    truth_elems, got_elems = _split_tuple(truth), _split_tuple(got)
    if len(truth_elems) > 1 and (truth[0] != got[0] or truth[-1] != got[-1]):
        return False  # (a, b) is not [a, b]
    if len(truth_elems) != len(got_elems):
        return False
    for t, g in zip(truth_elems, got_elems):
        if _is_frac(t) and _is_frac(g):
            ok = t == g  # an unreduced fraction is wrong: no simplification
        elif _str_is_int(t) != _str_is_int(g):
            ok = False  # an integer answer must match exactly
        else:
            ok = _equal_under_sympy(t, g)
        if not ok:
            return False
    return True


# ---- answer extraction ------------------------------------------------------------------------
def _last_boxed_only_string(text: str) -> str | None:
    idx = text.rfind("\\boxed")
    if idx < 0:
        idx = text.rfind("\\fbox")
        if idx < 0:
            return None
    depth = 0
    for i in range(idx, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[idx: i + 1]
    return None


def extract_answer(passage: str) -> str | None:
    """The contents of the last \\boxed{...}, or None (no box, unbalanced, or an \\fbox)."""
    if "\\boxed" not in passage:
        return None
    boxed = _last_boxed_only_string(passage)
    if boxed is None or not boxed.startswith("\\boxed{") or not boxed.endswith("}"):
        return None
    return boxed[len("\\boxed{"): -1]


def grade_answer_verl(solution: str, ground_truth: Any) -> bool:
    """--rm-type math: the response's last \\boxed{} answer against the label."""
    if not ground_truth:
        return False
    label = str(ground_truth)
    truth = extract_answer(label) if "\\boxed" in label else label  # None: unbalanced, which no answer equals
    given = extract_answer(solution)
    if given is None or truth is None:
        return False
    return grade_answer_mathd(given, truth) or grade_answer_sympy(given, truth)


def deepscaler_reward(response: str, label: Any) -> int:
    """--rm-type deepscaler: 1 if the boxed answer after the reasoning (after "</think>", or after
    "###Response") is right, else 0; a response with neither marker scores 0."""
    if "</think>" in response:
        solution = response.split("</think>")[-1]
    elif "###Response" in response:
        solution = response.split("###Response")[1]
    else:
        return 0
    answer = extract_answer(solution)
    if answer is None or label == "":
        return 0
    if not isinstance(label, (str, float, int)):
        raise ValueError(f"deepscaler reward: the label must be a string or a number, got {type(label).__name__}")
    truth = str(label)
    if "\\boxed" in truth:
        boxed = extract_answer(truth)
        if boxed is None:
            return 0
        truth = boxed
    return int(grade_answer_mathd(answer, truth) or grade_answer_sympy(answer, truth))
