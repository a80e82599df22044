"""--rm-type ifbench: slime's IFBench reward (rm_hub/ifbench.py), scored by IFBench's own rules
(allenai/IFBench's evaluation_lib: test_instruction_following_strict). 1.0 when the response
follows every instruction the sample's metadata lists (instruction_id_list, kwargs, prompt_text,
record_id), else 0.0.

slime clones IFBench and pip-installs its requirements at import; slurmrl installs nothing at run
time: evaluation_lib must be importable (IFBench's folder on PYTHONPATH), and `slurmrl submit`
refuses a job that asks for ifbench where it is not (missing_evaluation_lib)."""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any

EVALUATION_LIB = "evaluation_lib"
INSTALL = ("git clone https://github.com/allenai/IFBench, pip install -r IFBench/requirements.txt, and put the "
           "IFBench folder on PYTHONPATH (its evaluation_lib scores the instructions)")


class IFBenchMissing(ImportError):
    """IFBench's evaluation_lib cannot be imported."""


def missing_evaluation_lib() -> str | None:
    """Why ifbench cannot score here, or None when it can."""
    try:
        importlib.import_module(EVALUATION_LIB)
    except ImportError as err:
        return f"IFBench's {EVALUATION_LIB} cannot be imported ({err}): {INSTALL}"
    return None


def _evaluation_lib() -> Any:
    try:
        return importlib.import_module(EVALUATION_LIB)
    except ImportError as err:
        raise IFBenchMissing(f"--rm-type ifbench: IFBench's {EVALUATION_LIB} cannot be imported ({err}); {INSTALL}") \
            from None


def _instruction_ids(raw: Sequence[Any] | None) -> list[str]:
    return [text for text in (str(e).strip() for e in raw or [] if e is not None) if text]


def _kwargs_list(raw: Any, count: int) -> list[dict[str, Any]]:
    """The stored kwargs as one dict per instruction (slime's _coerce_kwargs_list): a list is
    padded with copies of its last entry or cut, one dict is repeated; None values are dropped."""
    if isinstance(raw, list):
        out = [dict(e) if isinstance(e, dict) else {} for e in raw]
    elif isinstance(raw, dict):
        out = [dict(raw) for _ in range(count)]
    else:
        out = [{} for _ in range(count)]
    if len(out) < count:
        tail = out[-1] if out else {}
        out += [dict(tail) for _ in range(count - len(out))]
    return [{k: v for k, v in e.items() if v is not None} for e in out[:count]]


def ifbench_reward(response: str | None, label: Any, metadata: dict[str, Any] | None) -> float:
    if not metadata or response is None:
        return 0.0
    ids = _instruction_ids(metadata.get("instruction_id_list"))
    if not ids:
        return 0.0
    lib = _evaluation_lib()
    prompt = "" if metadata.get("prompt_text") is None else str(metadata["prompt_text"])
    example = lib.InputExample(key=int(metadata.get("record_id") or 0), instruction_id_list=ids, prompt=prompt,
                               kwargs=_kwargs_list(metadata.get("kwargs"), len(ids)))
    output = lib.test_instruction_following_strict(example, {prompt: str(response or "")})
    return 1.0 if output.follow_all_instructions else 0.0
