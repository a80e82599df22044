"""--save-debug-rollout-data / --load-debug-rollout-data in slime's layout, so a dump made by
slime loads here and one made here loads in slime (slime/observability/rollout_data_utils.py):

    torch.save({"rollout_id": rollout_id, "samples": [Sample.to_dict(), ...]}, path)

`path` is the template formatted with rollout_id (for an eval, rollout_id="eval_<id>"); the
samples are one flat list, a prompt's samples sharing group_index; each dict has slime's Sample
field names (`weight_versions`, a list: slurmrl keeps its first as `oldest_weight_version` and its last as
`weight_version`), and
slurmrl's `spans` (rollout.trace: slime reads it as an extra attribute; a dump without it loads with none).
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

from rollout.engine_client import version_from_wire, version_to_wire
from rollout.sample import Sample, Status

# slime's Sample fields slurmrl does not keep, with the value that means "not used": written so
# slime reads our dumps as its own, and refused on load when a slime dump sets them otherwise.
_SLIME_ONLY: dict[str, Any] = {
    "rollout_id": None, "multimodal_inputs": None, "multimodal_train_inputs": None,
    "multimodal_train_input_id": None, "apply_chat_template_kwargs": {}, "rollout_top_p_token_ids": None,
    "rollout_top_p_token_offsets": None, "rollout_routed_experts": None, "remove_sample": False,
    "teacher_log_probs": None, "generate_function_path": None, "custom_rm_path": None, "train_metadata": None,
    "session_id": None, "non_generation_time": 0.0,
    "spec_info": {"spec_accept_token_num": 0, "spec_draft_token_num": 0, "spec_verify_ct": 0,
                  "completion_token_num": 0},
    "prefix_cache_info": {"cached_tokens": 0, "total_prompt_tokens": 0},
}
# Of those, the ones that change what training does: a dump that sets them cannot be replayed here.
_TRAINING_FIELDS = ("multimodal_train_inputs", "rollout_top_p_token_ids", "rollout_routed_experts",
                    "remove_sample", "teacher_log_probs", "train_metadata")


class DebugDataError(ValueError):
    """A dump that cannot be read or replayed; the message names the file and the field."""


def path_of(template: str, rollout_id: int, evaluation: bool = False) -> Path:
    """slime's: the template formatted with rollout_id (without {rollout_id}: one file for all)."""
    try:
        return Path(template.format(rollout_id=("eval_" if evaluation else "") + str(rollout_id)))
    except (KeyError, IndexError, ValueError):
        raise DebugDataError(f"debug rollout data path {template!r}: the only field it may hold is "
                             "{rollout_id}") from None


def to_slime_dict(sample: Sample) -> dict[str, Any]:
    d = {**_SLIME_ONLY, **sample.to_dict()}
    d["apply_chat_template_kwargs"], d["spec_info"], d["prefix_cache_info"] = (
        {}, dict(_SLIME_ONLY["spec_info"]), dict(_SLIME_ONLY["prefix_cache_info"]))
    version, oldest = d.pop("weight_version"), d.pop("oldest_weight_version")
    versions = [v for v in dict.fromkeys((oldest, version)) if v is not None]
    d["weight_versions"] = [version_to_wire(v) for v in versions]  # slime's: strings, oldest first
    return d


def from_slime_dict(d: dict[str, Any], where: str) -> Sample:
    for name in _TRAINING_FIELDS:
        if d.get(name, _SLIME_ONLY[name]) not in (None, False):
            raise DebugDataError(f"{where}: sample {d.get('index')} sets {name}, which slurmrl's trainer does not "
                                 "use; replay it with slime or dump without it")
    if isinstance(d.get("reward"), dict):
        raise DebugDataError(f"{where}: sample {d.get('index')} has a dict reward {sorted(d['reward'])}; "
                             "slurmrl replays a number per sample: dump the chosen reward (slime's --reward-key)")
    try:
        status = Status(d["status"])
    except ValueError:
        raise DebugDataError(f"{where}: sample {d.get('index')} has status {d['status']!r}; slurmrl knows "
                             f"{', '.join(s.value for s in Status)}") from None
    versions = d.get("weight_versions") or []
    return Sample(index=d["index"], group_index=d["group_index"], prompt=d.get("prompt", ""),
                  tokens=list(d.get("tokens") or []), response=d.get("response", ""),
                  response_length=d.get("response_length", 0), label=d.get("label"), reward=d.get("reward"),
                  loss_mask=list(d.get("loss_mask") or []), status=status,
                  rollout_log_probs=list(d.get("rollout_log_probs") or []),
                  weight_version=version_from_wire(versions[-1]) if versions else None,
                  oldest_weight_version=version_from_wire(versions[0]) if len(versions) > 1 else None,
                  metadata=dict(d.get("metadata") or {}),
                  spans=list(d.get("spans") or []))  # dumps older than rollout.trace have none


def save(template: str, rollout_id: int, samples: list[Sample], evaluation: bool = False) -> Path:
    import torch

    path = path_of(template, rollout_id, evaluation)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Not fsync'd: a debug dump lost to a node crash is no loss. Renamed into place: never half a file.
    tmp = path.with_name(f".{path.name}.tmp")
    torch.save({"rollout_id": rollout_id, "samples": [to_slime_dict(s) for s in samples]}, tmp)
    tmp.replace(path)
    return path


def read_dump(path: Path) -> dict[str, Any]:
    """A rollout dump as saved (slurmrl's or slime's): {"rollout_id", "samples": [dict], ...}."""
    import torch

    if not path.is_file():
        raise DebugDataError(f"{path} does not exist (was that rollout saved with --save-debug-rollout-data?)")
    try:
        data = torch.load(path, weights_only=False)
    except Exception as err:  # noqa: BLE001 - any unreadable file gets the same one-line answer
        raise DebugDataError(f"{path} is not a torch.save file ({str(err)[:120]})") from None
    if not isinstance(data, dict) or not isinstance(data.get("samples"), list):
        raise DebugDataError(f"{path} holds no 'samples' list (not a slime rollout dump)")
    return data


def load(template: str, rollout_id: int) -> list[list[Sample]]:
    """The rollout's samples, grouped by group_index in the dump's order."""
    path = path_of(template, rollout_id)
    try:
        data = read_dump(path)
    except DebugDataError as err:
        raise DebugDataError(f"--load-debug-rollout-data: {err}") from None
    samples = [from_slime_dict(d, str(path)) for d in data["samples"]]
    return [list(group) for _, group in itertools.groupby(samples, key=lambda s: s.group_index)]
