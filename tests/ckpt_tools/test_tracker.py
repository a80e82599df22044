"""Megatron's save-folder names, made and read in one place."""

from __future__ import annotations

from ckpt_tools.tracker import iteration_dirname, iteration_of


def test_iteration_folder_names_round_trip() -> None:
    assert [iteration_of(iteration_dirname(i)) for i in (0, 7, 12345678)] == [0, 7, 12345678]
    assert [iteration_of(name) for name in ("release", "iter_12", ".iter_0000006.tmp-x", "iter_0000001x")] == [None] * 4
