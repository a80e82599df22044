"""The eval sets: --eval-prompt-data NAME PATH [NAME PATH ...] with the --eval-* flags, or slime's
--eval-config YAML (examples/eval_multi_task/multi_task.yaml):

    eval:
      defaults: {max_response_len: 16384, top_p: 0.7}     # for every set
      datasets:                                            # a list, or a mapping name -> set
        - {name: aime, path: /data/aime.jsonl, rm_type: deepscaler, n_samples_per_eval_prompt: 16}

Each field of a set comes from the set, else the defaults, else the flags (slime's order:
eval_config.py's specs). A set's rm_type and metadata_overrides go into its samples' metadata, its
custom_rm_path and custom_generate_function_path onto its samples, where they win over the flags'.
slime's set fields slurmrl does not have are refused, each with why.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any

from contract.yaml_file import YamlFileError, read_yaml
from rollout.sample import Sample

LEGACY_NAME = "aime"  # slime's name for a lone --eval-prompt-data PATH
CONFIG = "--eval-config"

_UNSUPPORTED = {  # slime's EvalDatasetConfig fields slurmrl does not have: why
    "multimodal_keys": "slurmrl trains text-only models",
    "min_new_tokens": "min_new_tokens is not a sampling parameter slurmrl sends",
    "repetition_penalty": "repetition_penalty is not a sampling parameter slurmrl sends",
    "skip_special_tokens": "eval responses keep special tokens, as slime's default (--rollout-skip-special-tokens "
                           "sets it for every set)",
    "no_stop_trim": "matched stop strings stay in the response, as slime's default",
    "app_service": "slime's AppServer generation is not supported",
    "eval_task_timeout": "an eval set runs to its end; its requests are bounded by --rollout-retry-timeout",
    "min_eval_samples": "an eval set runs to its end",
    "eval_early_stop_remaining": "an eval set runs to its end",
    "eval_early_stop_idle_timeout": "an eval set runs to its end",
    "message_processor": "slime's per-source message processors are not supported",
    "reward_model": "give the set an rm_type or custom_rm_path",
    "remote_environment": "slime's remote environments are not supported",
}
# set field -> the flags (by slime's Namespace names) it falls back to, in order
_FROM_FLAGS = {
    "input_key": ("eval_input_key", "input_key"), "label_key": ("eval_label_key", "label_key"),
    "metadata_key": ("metadata_key",), "tool_key": ("tool_key",),
    "n_samples_per_eval_prompt": ("n_samples_per_eval_prompt", "n_samples_per_prompt"),
    "temperature": ("eval_temperature", "rollout_temperature"), "top_p": ("eval_top_p", "rollout_top_p"),
    "top_k": ("eval_top_k", "rollout_top_k"), "max_response_len": ("eval_max_response_len", "rollout_max_response_len"),
    "stop": ("rollout_stop",), "stop_token_ids": ("rollout_stop_token_ids",),
    "apply_chat_template": ("apply_chat_template",), "apply_chat_template_kwargs": ("apply_chat_template_kwargs",),
    "custom_rm_path": ("eval_custom_rm_path",),  # slime's: the flags' --custom-rm-path applies anyway
}


class EvalConfigError(ValueError):
    """Bad eval flags or --eval-config; the message names the flag (or file and set) and the fix."""


@dataclass(frozen=True)
class EvalSet:
    """One eval set, by slime's EvalDatasetConfig names (an --eval-function-path plug-in reads
    them as args.eval_datasets)."""

    name: str
    path: str
    input_key: str
    label_key: str | None
    metadata_key: str | None
    n_samples_per_eval_prompt: int
    temperature: float
    top_p: float
    top_k: int
    max_response_len: int
    tool_key: str | None = None
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    apply_chat_template: bool = False
    apply_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    rm_type: str | None = None  # into each sample's metadata: wins over --rm-type
    custom_rm_path: str | None = None  # on each sample: wins over --custom-rm-path
    custom_generate_function_path: str | None = None  # on each sample: wins over --custom-generate-function-path
    metadata_overrides: dict[str, Any] = field(default_factory=dict)

    def inject_metadata(self, metadata: dict[str, Any]) -> dict[str, Any]:
        """slime's: a sample's metadata with the set's rm_type and overrides."""
        return {**metadata, **({"rm_type": self.rm_type} if self.rm_type else {}), **self.metadata_overrides}

    def stamp(self, sample: Sample) -> None:
        """Give one of the set's samples the set's reward and generate functions (slime's eval rollout)."""
        sample.metadata = self.inject_metadata(sample.metadata)
        sample.custom_rm_path = self.custom_rm_path
        sample.generate_function_path = self.custom_generate_function_path


def _from_flags(args: Any, name: str) -> Any:
    return next((getattr(args, attr) for attr in _FROM_FLAGS[name] if getattr(args, attr, None) is not None), None)


def eval_sets(args: Any) -> list[EvalSet]:
    """The sets of --eval-config, or of --eval-prompt-data NAME PATH [NAME PATH ...]."""
    if getattr(args, "eval_config", None):
        if args.eval_prompt_data:
            raise EvalConfigError(f"give the eval sets in {CONFIG} or as --eval-prompt-data, not both")
        sets = _from_config(args, Path(args.eval_config))
    else:
        values = list(args.eval_prompt_data or [])
        if len(values) == 1:
            values = [LEGACY_NAME, values[0]]
        if len(values) % 2:
            raise EvalConfigError(f"--eval-prompt-data takes NAME PATH pairs, got {len(values)} values: {values}")
        sets = [_eval_set(args, {"name": name, "path": path}, {}, "--eval-prompt-data")
                for name, path in zip(values[0::2], values[1::2])]
    names = [s.name for s in sets]
    if len(set(names)) != len(names):
        raise EvalConfigError(f"--eval-prompt-data: each set needs its own name, got {names}")
    return sets


def _from_config(args: Any, path: Path) -> list[EvalSet]:
    try:
        data = read_yaml(path)
    except YamlFileError as err:
        raise EvalConfigError(f"{CONFIG} {path}: {err}") from None
    if not isinstance(data, dict):
        raise EvalConfigError(f"{CONFIG} {path}: must hold a mapping (eval: {{defaults: ..., datasets: ...}})")
    section = data.get("eval", data)
    defaults = section.get("defaults") or {} if isinstance(section, dict) else None
    if not isinstance(section, dict) or not isinstance(defaults, dict):
        raise EvalConfigError(f"{CONFIG} {path}: `eval` and `eval.defaults` must be mappings")
    raw = section.get("datasets")
    if isinstance(raw, dict):
        raw = [{"name": name, **(cfg or {})} for name, cfg in raw.items()]
    if not raw or not isinstance(raw, list) or not all(isinstance(d, dict) for d in raw):
        raise EvalConfigError(f"{CONFIG} {path}: eval.datasets must list the sets (each a mapping with name and path)")
    where = f"{CONFIG} {path}"
    _check_keys(defaults, f"{where}: eval.defaults")
    return [_eval_set(args, dataset, defaults, where) for dataset in raw]


def _check_keys(entry: dict[str, Any], where: str) -> None:
    known = {f.name for f in fields(EvalSet)}
    for key, value in entry.items():
        if key in _UNSUPPORTED:
            raise EvalConfigError(f"{where}: {key}: {_UNSUPPORTED[key]}")
        if key not in known:
            raise EvalConfigError(f"{where}: unknown key {key!r}; known: {', '.join(sorted(known))}")
        if isinstance(value, str) and "${" in value:
            raise EvalConfigError(f"{where}: {key}: {value!r} is an OmegaConf interpolation, which slurmrl does not "
                                  "resolve; write the value")


def _eval_set(args: Any, dataset: dict[str, Any], defaults: dict[str, Any], where: str) -> EvalSet:
    name = dataset.get("name")
    if not name or not dataset.get("path"):
        raise EvalConfigError(f"{where}: every eval set needs a name and a path, got {dataset}")
    _check_keys(dataset, f"{where}: set {name}")
    values: dict[str, Any] = {}
    for f in fields(EvalSet):
        if f.name in dataset:
            values[f.name] = dataset[f.name]
        elif f.name in defaults:
            values[f.name] = defaults[f.name]
        elif f.name in _FROM_FLAGS and _from_flags(args, f.name) is not None:
            values[f.name] = _from_flags(args, f.name)
    if not Path(values["path"]).is_file():
        at = f"{where} {name} {values['path']}" if where == "--eval-prompt-data" else f"{where}: set {name}: " \
                                                                                      f"{values['path']}"
        raise EvalConfigError(f"{at}: no such file; give a jsonl file")
    for optional in ("label_key", "metadata_key"):  # may be none at all
        values.setdefault(optional, None)
    missing = [f.name for f in fields(EvalSet)
               if f.name not in values and f.default is MISSING and f.default_factory is MISSING]
    if missing:
        raise EvalConfigError(f"{where}: set {name}: no {', '.join(missing)} (from the set, the defaults or the flags)")
    return EvalSet(**values)
