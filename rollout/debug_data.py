"""--save-debug-rollout-data / --load-debug-rollout-data: a rollout's samples as JSON, so a
training problem can be replayed without engines (--debug-train-only) and a rollout inspected."""

from __future__ import annotations

import json
from pathlib import Path

from jobs.contract import write_atomic
from rollout.sample import Sample


def _path(template: str, rollout_id: int) -> Path:
    if "{rollout_id}" not in template:
        raise ValueError(f"debug rollout data path {template!r} must contain {{rollout_id}}")
    return Path(template.format(rollout_id=rollout_id))


def save(template: str, rollout_id: int, groups: list[list[Sample]]) -> Path:
    # A reader never sees half a file; not fsync'd: a debug dump lost to a node crash is no loss.
    data = json.dumps({"rollout_id": rollout_id, "groups": [[s.to_dict() for s in g] for g in groups]})
    return write_atomic(_path(template, rollout_id), data, durable=False)


def load(template: str, rollout_id: int) -> list[list[Sample]]:
    path = _path(template, rollout_id)
    if not path.is_file():
        raise FileNotFoundError(f"--load-debug-rollout-data: {path} does not exist (was rollout {rollout_id} saved?)")
    data = json.loads(path.read_text())
    return [[Sample.from_dict(s) for s in group] for group in data["groups"]]
