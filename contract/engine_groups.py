"""The job's engine groups: which engines are regular, prefill or decode (prefill/decode
disaggregation), and each group's own SGLang flags. They come from slime's `--prefill-num-servers N`
(N prefill engines, the rest decode) or its `--sglang-config FILE` (docs/en/advanced/sglang-config.md
in slime), read once at submission into `rollout.engine_groups`, so a requeued job keeps the
topology it was submitted with. Every problem is one line naming the field and the fix.

`rollout.engine_groups` holds one string per group: `ROLE COUNT [SGLANG FLAG ...]` (shell quoting),
e.g. `decode 2 --mem-fraction-static 0.7`; engines are numbered group after group.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from contract.spec import JobSpec
from contract.yaml_file import YamlFileError, read_yaml

REGULAR, PREFILL, DECODE = "regular", "prefill", "decode"
ROLES = (REGULAR, PREFILL, DECODE)
# slime's worker types slurmrl does not run, and why
_REFUSED_TYPES = {
    "placeholder": "reserving GPUs without an engine is not supported; size --rollout-num-gpus to the engines",
    "encoder": "encoder-only engines (EPD disaggregation) are not supported",
}
_GROUP_KEYS = {"worker_type", "num_gpus", "num_gpus_per_engine", "overrides"}
_MODEL_KEYS = {"name", "model_path", "update_weights", "num_gpus_per_engine", "server_groups", "engine_groups"}


@dataclass(frozen=True)
class EngineGroup:
    role: str
    count: int
    flags: tuple[str, ...] = ()  # SGLang flags of this group's engines, after the job's --sglang-*

    def text(self) -> str:
        return shlex.join([self.role, str(self.count), *self.flags])

    @classmethod
    def parse(cls, text: str) -> EngineGroup:
        role, count, *flags = shlex.split(text)
        if role not in ROLES or not count.isdigit():
            raise ValueError(f"rollout.engine_groups: {text!r} is not 'ROLE COUNT [FLAGS]' with ROLE one of "
                             f"{', '.join(ROLES)}")
        return cls(role, int(count), tuple(flags))


def groups(spec: JobSpec) -> list[EngineGroup]:
    """The job's groups: rollout.engine_groups once resolved, else from --prefill-num-servers."""
    r = spec.rollout
    if r.engine_groups:
        return [EngineGroup.parse(text) for text in r.engine_groups]
    if r.prefill_num_servers:
        return _pd_split(r.prefill_num_servers, r.engine_count)
    return [EngineGroup(REGULAR, r.engine_count)]


def engine_roles(spec: JobSpec) -> list[tuple[str, tuple[str, ...]]]:
    """(role, group flags) of engine 0, 1, ..."""
    return [(g.role, g.flags) for g in groups(spec) for _ in range(g.count)]


def is_pd(spec: JobSpec) -> bool:
    """Prefill/decode disaggregation: the router runs in its PD mode."""
    return any(g.role != REGULAR for g in groups(spec))


def resolve(spec: JobSpec) -> list[str]:
    """Fill rollout.engine_groups from --sglang-config or --prefill-num-servers (in place);
    returns the problems (then the spec is left as it was)."""
    r = spec.rollout
    if r.engine_groups:
        return []
    if r.sglang_config and r.prefill_num_servers is not None:
        return ["rollout.sglang_config: --sglang-config and --prefill-num-servers are mutually exclusive (slime's "
                "rule); give the prefill and decode groups in the config's server_groups"]
    if (r.sglang_config or r.prefill_num_servers is not None) and r.external_router:
        return ["rollout.sglang_router_ip: an external router's mode and workers are its own; drop "
                "--prefill-num-servers/--sglang-config or --sglang-router-ip"]
    if r.sglang_config:
        found, problems = read_sglang_config(Path(r.sglang_config), spec)
    elif r.prefill_num_servers is not None:
        found, problems = _pd_split(r.prefill_num_servers, r.engine_count), []
    else:
        return []
    problems = problems or _pd_problems(found, "--sglang-config" if r.sglang_config else "--prefill-num-servers")
    if not problems:
        r.engine_groups = [g.text() for g in found]
    return problems


def _pd_split(prefill: int, total: int) -> list[EngineGroup]:
    """--prefill-num-servers: that many prefill engines, the rest of the job's decode ones."""
    return [EngineGroup(PREFILL, prefill), EngineGroup(DECODE, total - prefill)]


def _pd_problems(found: list[EngineGroup], where: str) -> list[str]:
    counts = {role: sum(g.count for g in found if g.role == role) for role in ROLES}
    if not counts[PREFILL] and not counts[DECODE]:
        return []
    by_flag = where == "--prefill-num-servers"
    field = "rollout.prefill_num_servers" if by_flag else "rollout.sglang_config"
    fix = "lower --prefill-num-servers below the number of engines" if by_flag else "add a decode group"
    if counts[REGULAR]:
        return [f"rollout.sglang_config: {where} mixes regular engines with prefill/decode ones, and a PD router "
                "routes every request through a prefill and a decode engine; make every group prefill or decode"]
    if counts[DECODE] < 1:
        return [f"{field}: {where} leaves no decode engine ({counts[PREFILL]} prefill of "
                f"{counts[PREFILL] + counts[REGULAR]} engines); {fix}"]
    if counts[PREFILL] < 1:
        return [f"{field}: {where} leaves no prefill engine; give --prefill-num-servers 1 or "
                "more (or a prefill group)"]
    return []


def read_sglang_config(path: Path, spec: JobSpec) -> tuple[list[EngineGroup], list[str]]:
    """slime's SGLang config YAML -> groups, and the problems (one line each, naming the field)."""
    where = f"--sglang-config {path}"
    try:
        data = read_yaml(path)
    except YamlFileError as err:
        return [], [f"{where}: {err}; give slime's SGLang config YAML"]
    models = data.get("sglang") if isinstance(data, dict) else None
    if not isinstance(models, list) or not models:
        return [], [f"{where}: needs a top-level 'sglang' list of models (slime's format)"]
    if len(models) > 1:
        return [], [f"{where}: sglang[1]: several models (each behind its own router) are not supported; serve "
                    "one model, the one trained"]
    return _model_groups(models[0], spec, f"{where}: sglang[0]")


def _model_groups(model: Any, spec: JobSpec, where: str) -> tuple[list[EngineGroup], list[str]]:
    r = spec.rollout
    if not isinstance(model, dict):
        return [], [f"{where}: must be a mapping (name, server_groups, ...)"]
    unknown = set(model) - _MODEL_KEYS
    if unknown:
        return [], [f"{where}: unknown field {sorted(unknown)[0]!r}; known: {', '.join(sorted(_MODEL_KEYS))}"]
    model_path = model.get("model_path")
    if model.get("update_weights") is False or (model_path and model_path != spec.trainer.hf_checkpoint):
        return [], [f"{where}.update_weights: a frozen model (update_weights: false, or a model_path other than "
                    "--hf-checkpoint) is not supported; serve the trained model only"]
    raw_groups = model.get("server_groups") or model.get("engine_groups")
    if not isinstance(raw_groups, list) or not raw_groups:
        return [], [f"{where}.server_groups: needs a list of groups (worker_type, num_gpus)"]
    default_per_engine = model.get("num_gpus_per_engine") or r.rollout_num_gpus_per_engine
    found: list[EngineGroup] = []
    problems: list[str] = []
    for i, raw in enumerate(raw_groups):
        group, problem = _group(raw, default_per_engine, spec, f"{where}.server_groups[{i}]")
        if group is not None:
            found.append(group)
        elif problem:
            problems.append(problem)
    if problems:
        return [], problems
    gpus = sum(g.count for g in found) * r.rollout_num_gpus_per_engine
    counted = r.engine == "cpu" or r.engines_share_gpus  # engines not one per GPU: counted, not sized
    if counted and sum(g.count for g in found) != r.engine_count:
        return [], [f"{where}.server_groups: they make {sum(g.count for g in found)} engines, the job has "
                    f"{r.engine_count} (--rollout-num-engines); make them equal"]
    if not counted and gpus != r.rollout_num_gpus:
        return [], [f"{where}.server_groups: their num_gpus add up to {gpus}, --rollout-num-gpus is "
                    f"{r.rollout_num_gpus} (slime's rule: they must be equal); give --rollout-num-gpus {gpus}"]
    return found, []


def _group(raw: Any, default_per_engine: int, spec: JobSpec, where: str) -> tuple[EngineGroup | None, str | None]:
    if not isinstance(raw, dict):
        return None, f"{where}: must be a mapping (worker_type, num_gpus, ...)"
    unknown = set(raw) - _GROUP_KEYS
    if unknown:
        return None, f"{where}: unknown field {sorted(unknown)[0]!r}; known: {', '.join(sorted(_GROUP_KEYS))}"
    kind = raw.get("worker_type")
    if kind in _REFUSED_TYPES:
        return None, f"{where}.worker_type: {kind}: {_REFUSED_TYPES[kind]}"
    if kind not in ROLES:
        return None, f"{where}.worker_type: {kind!r} is not one of {', '.join(ROLES)}"
    gpus, per_engine = raw.get("num_gpus"), raw.get("num_gpus_per_engine") or default_per_engine
    if not isinstance(gpus, int) or isinstance(gpus, bool) or gpus < 1:
        return None, f"{where}.num_gpus: {gpus!r} must be a whole number above 0"
    if per_engine != spec.rollout.rollout_num_gpus_per_engine:
        return None, (f"{where}.num_gpus_per_engine: {per_engine} differs from --rollout-num-gpus-per-engine "
                      f"{spec.rollout.rollout_num_gpus_per_engine}; engines of several sizes are not supported yet, "
                      "give every group the job's size")
    if gpus % per_engine:
        return None, f"{where}.num_gpus: {gpus} is not a multiple of num_gpus_per_engine {per_engine}"
    flags, problem = _override_flags(raw.get("overrides") or {}, spec, f"{where}.overrides")
    return (None, problem) if problem else (EngineGroup(kind, gpus // per_engine, flags), None)


def _override_flags(overrides: Any, spec: JobSpec, where: str) -> tuple[tuple[str, ...], str | None]:
    """slime's ServerArgs overrides {field: value} as SGLang flags (true: a bare flag, false: none)."""
    if not isinstance(overrides, dict):
        return (), f"{where}: must be a mapping of SGLang ServerArgs fields to values"
    flags: list[str] = []
    for key, value in overrides.items():
        if key == "model_path" and value == spec.trainer.hf_checkpoint:
            continue  # slime injects it; the engines load --hf-checkpoint anyway
        flag = "--" + str(key).replace("_", "-")
        if value is True:
            flags.append(flag)
        elif isinstance(value, list):
            flags += [flag, *map(str, value)]
        elif value is not False and value is not None:
            flags += [flag, str(value)]
    return tuple(flags), None  # flags slurmrl sets itself are refused by jobs/validate.py
