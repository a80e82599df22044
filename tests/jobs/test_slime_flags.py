"""Every one of slime's flags is taken with its effect or refused with its reason (never accepted
and ignored), and docs/flags.md, the table of them, is current."""

from __future__ import annotations

from pathlib import Path

import pytest

from jobs.submit_flags import MISSING, flag_rows, markdown
from trainer.args import ArgsError, build_parser

DOC = Path(__file__).resolve().parents[2] / "docs" / "flags.md"


def test_every_slime_flag_is_taken_or_refused() -> None:
    rows = flag_rows()
    assert len(rows) > 300
    assert [r.flag for r in rows if r.taken_by == MISSING] == []


def test_a_refused_flag_stops_with_its_reason_unless_given_the_accepted_value() -> None:
    parser, required = build_parser(), ["--hf-checkpoint", "m", "--num-rollout", "1"]
    refused = [a for a in parser._actions if getattr(a, "reason", None) is not None]
    assert len(refused) > 50
    for action in refused:
        flag = action.option_strings[0]
        value = [] if action.nargs == 0 else ["7"] if action.nargs is None else ["7", "8"]
        if action.allowed is not None and action.nargs != 0:  # the accepted value passes
            accepted = action.allowed if isinstance(action.allowed, list) else [action.allowed]
            assert getattr(parser.parse_known_args([*required, flag, *map(str, accepted)])[0], action.dest) == action.allowed
        if action.nargs == 0 and action.allowed is True:
            continue  # a switch naming what slurmrl always does: it has no other value
        with pytest.raises(ArgsError) as err:
            parser.parse_known_args([*required, flag, *value])
        assert str(err.value).startswith(flag) and action.reason in str(err.value)


def test_the_flag_table_in_the_docs_is_current() -> None:
    assert DOC.read_text() == markdown(flag_rows()), "regenerate it: python -m jobs.submit_flags > docs/flags.md"
