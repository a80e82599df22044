"""The trainer parser's machinery: its error type, the parser that names unknown flags, the help
formatter, and the action of slime's flags that slurmrl refuses."""

from __future__ import annotations

import argparse
import ast
import difflib
import json
from typing import Any


class LayerPattern(list[int]):
    """A per-layer 0/1 list (1: MoE) that prints in Megatron's short form, [0]*3+[1]*58."""

    def __str__(self) -> str:
        runs: list[list[int]] = []
        for x in self:
            if runs and runs[-1][0] == x:
                runs[-1][1] += 1
            else:
                runs.append([x, 1])
        return "+".join(f"[{x}]*{n}" for x, n in runs) or "[]"


def moe_layer_freq(text: str) -> int | LayerPattern:
    """Megatron's --moe-layer-freq: N (every Nth layer is MoE) or a per-layer list, "[1, 1, 0, ...]"
    or the Python expression Megatron evaluates, "[0]*1+[1]*46"; 1 when every layer is MoE, else
    the list (DeepSeek's dense first layers: config.json's first_k_dense_replace)."""
    text = text.strip()
    if text.startswith("["):
        pattern = _layer_list(text)
        if pattern is None:
            raise argparse.ArgumentTypeError(f"{text!r} is not a list of 0/1 (or Megatron's [0]*K+[1]*N)")
        return 1 if pattern and all(x == 1 for x in pattern) else LayerPattern(pattern)
    return int(text)


def _layer_list(text: str) -> list[int] | None:
    """A list literal, or list literals repeated (*) and joined (+): Megatron's form, read without eval."""
    def value(node: ast.AST) -> list[int] | None:
        if isinstance(node, ast.List) and all(isinstance(e, ast.Constant) and e.value in (0, 1) for e in node.elts):
            return [int(e.value) for e in node.elts]  # type: ignore[attr-defined]
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult) and isinstance(node.right, ast.Constant):
            inner = value(node.left)
            return None if inner is None or not isinstance(node.right.value, int) else inner * node.right.value
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            left, right = value(node.left), value(node.right)
            return None if left is None or right is None else left + right
        return None
    try:
        return value(ast.parse(text, mode="eval").body)
    except SyntaxError:
        return None


class ArgsError(ValueError):
    """Flags' values are wrong: one line per problem (`problems`), each naming the flag and the fix;
    build_config reports every problem of a command line at once."""

    def __init__(self, *problems: str) -> None:
        super().__init__("\n".join(problems))
        self.problems = list(problems)


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        # Unknown flags get a suggestion ("--lrr: did you mean --lr?").
        if message.startswith("unrecognized arguments:"):
            known = [o for a in self._actions for o in a.option_strings]
            hints = []
            for flag in message.split(":", 1)[1].split():
                if flag.startswith("--"):
                    close = difflib.get_close_matches(flag.split("=")[0], known, n=1)
                    hints.append(f"{flag}" + (f" (did you mean {close[0]}?)" if close else ""))
            message = "unknown flag " + ", ".join(hints or [message])
        raise ArgsError(message)


class HelpFormatter(argparse.HelpFormatter):
    """Every flag shows its default (build_parser gives each flag some help: argparse shows a
    default only within a help text)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.option_strings and not action.required and action.default not in (None, False, argparse.SUPPRESS) \
                and "%(default)" not in text:
            text += " (default: %(default)s)"
        return text


class RefusedFlag(argparse.Action):
    """A slime flag slurmrl does not implement: a value other than `allowed` (the one that is
    what slurmrl does anyway) is refused with `reason`, never accepted and ignored."""

    def __init__(self, option_strings: list[str], dest: str, *, reason: str, allowed: Any = None,
                 **kwargs: Any) -> None:
        super().__init__(option_strings, dest, **kwargs)
        self.reason, self.allowed = reason, allowed

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        given = True if self.nargs == 0 else values
        if self.allowed is None or given != self.allowed:
            shown = option_string if self.nargs == 0 else f"{option_string} {values}"
            raise ArgsError(f"{shown}: {self.reason}")
        setattr(namespace, self.dest, given)


def refused(p: argparse.ArgumentParser, flag: str, reason: str, *, allowed: Any = None, type: Any = str,
            switch: bool = False, nargs: str | None = None) -> None:
    """Register slime's `flag` as refused: with `reason` whenever given (allowed None), or unless
    its value equals `allowed`. `switch`: a store_true flag (it takes no value)."""
    kwargs: dict[str, Any] = {"nargs": 0} if switch else {"type": type, "nargs": nargs}
    p.add_argument(flag, action=RefusedFlag, reason=reason, allowed=allowed, default=None,
                   help=f"refused: {reason}" + ("" if allowed is None else f" (accepted: {allowed})"), **kwargs)


class Choice:
    """An argparse type for a flag of named values: one of `allowed`, or refused with the reason
    `refused` gives for it (slime's and Megatron's other values), never a bare "invalid choice"."""

    def __init__(self, allowed: tuple[str, ...], refused: dict[str, str]) -> None:
        self.allowed, self.refused = allowed, refused
        self.__name__ = "choice"  # argparse names the type in its messages

    def __call__(self, value: str) -> str:
        if value in self.allowed:
            return value
        if value in self.refused:
            raise argparse.ArgumentTypeError(f"{value}: {self.refused[value]}")
        raise argparse.ArgumentTypeError(f"{value!r}: give one of {', '.join(self.allowed)}")

    @property
    def metavar(self) -> str:
        return "{" + ",".join(self.allowed) + "}"


def json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"not JSON ({err.msg}): give a JSON object") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(
            f"{text} is not a JSON object: give one, e.g. '{{\"enable_thinking\": false}}'")
    return value
