"""A stand-in for IFBench's evaluation_lib (allenai/IFBench), the two names slime's ifbench reward
uses: InputExample and test_instruction_following_strict. Its one instruction, "ends_with", is
followed when the response ends with kwargs["end"]; every other instruction id is unknown, as to
IFBench's registry."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass
class InputExample:
    key: int
    instruction_id_list: list[str]
    prompt: str
    kwargs: list[dict[str, Any]]


@dataclasses.dataclass
class OutputExample:
    instruction_id_list: list[str]
    prompt: str
    response: str
    follow_all_instructions: bool
    follow_instruction_list: list[bool]


def test_instruction_following_strict(inp: InputExample, prompt_to_response: dict[str, str]) -> OutputExample:
    response = prompt_to_response[inp.prompt]
    followed = []
    for instruction, kwargs in zip(inp.instruction_id_list, inp.kwargs):
        if instruction != "ends_with":
            raise KeyError(instruction)
        followed.append(response.strip().endswith(kwargs["end"]))
    return OutputExample(inp.instruction_id_list, inp.prompt, response, all(followed), followed)
