"""User functions named by dotted path (--custom-rm-path, --custom-generate-function-path,
--rollout-function-path, --dynamic-sampling-filter-path), as slime does, and which of their
failures a restart of the trainer would only meet again (PluginError, `repeats`)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import aiohttp

from rollout.errors import RolloutError


class PluginError(RolloutError, ValueError):
    """A user function that a restart would only fail on again: it does not load (no such module or
    function, an exception at import), or it raised outside any one sample, or on every sample of a
    rollout. The trainer ends with it as its fatal reason (trainer/fatal.py), and the supervisor
    fails the job at once. A ValueError too, as a bad flag value."""

    def __init__(self, message: str, flag: str, path: str) -> None:
        super().__init__(message)
        self.flag, self.path = flag, path


def load_function(path: str, flag: str) -> Callable[..., Any]:
    """`package.module.function` -> the function; a PluginError naming the flag otherwise."""
    module_name, _, name = path.rpartition(".")
    if not module_name:
        raise PluginError(f"{flag} {path!r} must be a dotted path like my_pkg.rewards.score", flag, path)
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise PluginError(f"{flag} {path!r}: cannot import {module_name} ({err})", flag, path) from None
    except Exception as err:  # the module's own code raised while it was imported
        raise PluginError(f"{flag} {path!r}: importing {module_name} raised {described(err)}", flag, path) from err
    function = getattr(module, name, None)
    if not callable(function):
        raise PluginError(f"{flag} {path!r}: {module_name} has no function {name}", flag, path)
    return function


def described(err: BaseException) -> str:
    """An exception in one line: its type and message."""
    return f"{type(err).__name__}: {err}"[:500]


# What a user function talks to may fail and be mended by the time the trainer restarts: the
# network, the engines (the rollout's own RolloutError), a reward server. TimeoutError is an OSError.
_FROM_OUTSIDE = (OSError, aiohttp.ClientError, RolloutError)


def repeats(err: Exception) -> bool:
    """Would a restart of the trainer meet `err` again? A user function's own exception (an
    AttributeError for a method slurmrl lacks, a KeyError, a TypeError...) would; a failure of what
    it talks to may not, so restarts stay for those."""
    return isinstance(err, PluginError) or not isinstance(err, _FROM_OUTSIDE)


def raised(flag: str, path: str, err: Exception, where: str) -> Exception:
    """What a user function's exception `err` becomes where it is not one sample's (a whole rollout,
    a filter's verdict): a PluginError if a restart would repeat it, else `err` itself."""
    if isinstance(err, PluginError) or not repeats(err):
        return err
    error = PluginError(f"{flag} {path} raised {described(err)} {where}", flag, path)
    error.__cause__ = err
    return error
