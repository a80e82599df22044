"""--custom-config-path: slime's YAML of arguments for custom functions, each key set on args as
slime sets it (after the flags, so it wins over them). A key that names a trainer flag changes
that flag (train_infer_mismatch_helper's mis.yaml turns on use_tis this way); a flag slurmrl
refuses is refused here too, with its reason; any other key is the plug-ins' own (multi_agent's,
mis.py's tis_mode...): it reaches them on args (TrainerConfig.plugin_namespace)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from contract.yaml_file import YamlFileError, read_yaml
from trainer.args_actions import ArgsError, RefusedFlag

FLAG = "--custom-config-path"


def apply_custom_config(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Set --custom-config-path's keys on args (in place); ArgsError naming the file and key."""
    path = getattr(args, "custom_config_path", None)
    if not path:
        return
    try:
        data = read_yaml(Path(path)) or {}
    except YamlFileError as err:
        raise ArgsError(f"{FLAG} {path}: {err}; give the YAML of your custom functions' arguments") from None
    if not isinstance(data, dict):
        raise ArgsError(f"{FLAG} {path}: must hold a mapping of argument: value")
    actions = {action.dest: action for action in parser._actions}
    problems = []
    for key, value in data.items():
        action = actions.get(str(key))
        if isinstance(action, RefusedFlag) and (action.allowed is None or value != action.allowed):
            problems.append(f"{FLAG} {path}: {key}: {action.reason}")
        elif action is not None and not _fits(action, value):
            problems.append(f"{FLAG} {path}: {key}: {value!r} is not a value of {action.option_strings[0]}")
        elif action is not None and action.type in (int, float) and value is not None:
            setattr(args, action.dest, action.type(value))
        else:
            setattr(args, str(key), value)
    if problems:
        raise ArgsError(*problems)


def _fits(action: argparse.Action, value: Any) -> bool:
    """A YAML value for a flag: of the flag's kind (a switch takes a bool, a number flag a number;
    YAML reads 1e-4 as a string, so write 1.0e-4, as slime's mis.yaml says) and among its choices."""
    if action.choices is not None and value not in action.choices:
        return False
    if action.nargs == 0:
        return isinstance(value, bool)
    if action.type in (int, float) and value is not None:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and (
            action.type is float or float(value).is_integer())
    return True
