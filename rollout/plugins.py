"""User functions named by dotted path (--custom-rm-path, --custom-generate-function-path,
--rollout-function-path, --dynamic-sampling-filter-path), as slime does."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def load_function(path: str, flag: str) -> Callable[..., Any]:
    """`package.module.function` -> the function; a clear error naming the flag otherwise."""
    module_name, _, name = path.rpartition(".")
    if not module_name:
        raise ValueError(f"{flag} {path!r} must be a dotted path like my_pkg.rewards.score")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"{flag} {path!r}: cannot import {module_name} ({err})") from None
    function = getattr(module, name, None)
    if not callable(function):
        raise ValueError(f"{flag} {path!r}: {module_name} has no function {name}")
    return function
