"""slime.utils.misc's load_function and SingletonMeta, as slime's plug-ins use them (multi_agent
loads its agent system with load_function; GenerateState is a SingletonMeta class)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from functools import cache
from typing import Any

__all__ = ["SingletonMeta", "load_function"]


@cache
def load_function(path: str) -> Callable[..., Any]:
    """`package.module.function` -> the function, cached as slime's is. A missing module or name
    raises ImportError / AttributeError, as in slime (slurmrl's own loader, rollout.plugins, names
    the flag; this one is the plug-ins')."""
    module_path, _, attr = path.rpartition(".")
    if not module_path:
        raise ImportError(f"load_function({path!r}): give a dotted path like my_pkg.module.function")
    return getattr(importlib.import_module(module_path), attr)


class SingletonMeta(type):
    """A class of one instance: the first construction's arguments win, as in slime."""

    _instances: dict[type, Any] = {}

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if cls not in cls._instances:
            cls._instances[cls] = super().__call__(*args, **kwargs)
        return cls._instances[cls]

    def clear_instances(cls) -> None:
        """Forget every instance (a test, or a run with new args, starts afresh)."""
        SingletonMeta._instances = {}
