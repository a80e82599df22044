"""Reading a user's YAML file (a job spec, --sglang-config, --eval-config, --custom-config-path) with
one line saying why it cannot be read. Each caller names its flag and checks the shape it needs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml


class YamlFileError(Exception):
    """Why the file cannot be read: "no such file", an OS error, or YAML's first line of complaint."""


def read_yaml(path: Path) -> Any:
    """The file's YAML (None for an empty file); YamlFileError saying why it cannot be read."""
    try:
        return yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise YamlFileError("no such file") from None
    except OSError as err:
        raise YamlFileError(f"cannot be read ({err.strerror})") from None
    except yaml.YAMLError as err:
        raise YamlFileError(f"cannot be read as YAML ({str(err).splitlines()[0]})") from None
