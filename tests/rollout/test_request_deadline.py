"""A request's deadline: the named bound before any speed is seen, then max_new_tokens over the
median speed of recent completed requests, times the slack, never under the floor; and what counts
as an engine's generate answer."""

from __future__ import annotations

import json

import pytest

from rollout.engine_check import BadAnswer, parse_answer
from rollout.request_deadline import DecodeSpeed


def test_the_deadline_follows_the_observed_speed_with_a_floor() -> None:
    speed = DecodeSpeed(slack=4.0, floor_s=30.0, unobserved_s=300.0)
    assert speed.deadline_s(1000) == 300.0  # nothing seen yet
    speed.observe(tokens=0, seconds=2.0)  # an answer with no tokens says nothing about speed
    assert speed.tokens_per_s() is None
    for tokens_per_s in (10.0, 20.0, 1000.0):
        speed.observe(tokens=int(tokens_per_s * 2), seconds=2.0)
    assert speed.tokens_per_s() == 20.0  # the median: one very fast request does not shorten it
    assert speed.deadline_s(1000) == 4.0 * 1000 / 20.0
    assert speed.deadline_s(10) == 30.0  # the floor


@pytest.mark.parametrize("text", ['{"text": "the answer is', "[]", '{"text": "x"}', "null",
                                  '{"text": "x", "output_ids": [1], "meta_info": {"finish_reason": null}}'])
def test_an_answer_that_is_not_a_generate_answer_is_refused(text: str) -> None:
    with pytest.raises(BadAnswer):
        parse_answer(text)


def test_a_generate_answer_parses_single_or_batched() -> None:
    one = {"text": "7", "output_ids": [7], "meta_info": {"finish_reason": {"type": "length", "length": 1}}}
    assert parse_answer(json.dumps(one)) == one
    assert parse_answer(json.dumps([one, one])) == one
