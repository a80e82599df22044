"""The checks of a command line, every failed one kept (build_config reports them all at once)."""

from __future__ import annotations

from trainer.args_parser import ArgsError


class Checks:
    """`need(ok, message)` for every check of a command line: the message of each one that fails is
    kept, and `raise_any` raises them all as one ArgsError."""

    def __init__(self) -> None:
        self.problems: list[str] = []

    def __call__(self, ok: bool, message: str) -> bool:
        if not ok:
            self.problems.append(message)
        return ok

    def raise_any(self) -> None:
        if self.problems:
            raise ArgsError(*self.problems)
