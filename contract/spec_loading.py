"""Reading a job spec (contract/spec.py) from YAML and slime-style flags, and filling in what the
user left out at submission. Every problem is one line naming the field and the fix."""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from contract import engine_groups
from contract.job_dir import JobDir
from contract.spec import (
    PATH_FLAGS,
    ROLES,
    SECTIONS,
    JobSpec,
    SpecError,
    flag_name,
    flag_value,
    group_flags,
    merge_flags,
    set_flag,
)
from contract.yaml_file import YamlFileError, read_yaml


def _fields(cls: type) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if f.name not in SECTIONS and f.metadata.get("flag", "") is not None]


def spec_flags() -> dict[str, tuple[str | None, dataclasses.Field]]:
    """`--flag` -> (section or None for the top level, field) for every spec field that has a flag."""
    out: dict[str, tuple[str | None, dataclasses.Field]] = {}
    for section, cls in [(None, JobSpec), *SECTIONS.items()]:
        for f in _fields(cls):
            out[f.metadata.get("flag") or "--" + f.name.replace("_", "-")] = (section, f)
    return out


def _convert(f: dataclasses.Field, raw: Any, where: str) -> tuple[Any, str | None]:
    """(value, problem) for a raw YAML or flag value of field f."""
    kind = str(f.type)
    if raw is None:
        return None, None if "None" in kind else f"{where}: needs a value"
    try:
        if kind.startswith("bool"):
            if isinstance(raw, bool):
                return raw, None
            if str(raw).lower() in ("true", "1", "yes", "on"):
                return True, None
            if str(raw).lower() in ("false", "0", "no", "off"):
                return False, None
            raise ValueError
        if kind.startswith("int"):
            if isinstance(raw, bool) or (isinstance(raw, float) and not raw.is_integer()):
                raise ValueError
            return int(raw), None
        if kind.startswith("float"):
            return float(raw), None
        if kind.startswith("list") and f.metadata.get("items"):
            return _as_items(raw, f.metadata["items"], where)
        if kind.startswith("list"):
            return _as_argv(raw, where)
        return os.path.expandvars(str(raw)), None
    except (TypeError, ValueError):
        return None, f"{where}: {raw!r} is not a valid {kind.split(' ')[0]}"


def _as_argv(raw: Any, where: str) -> tuple[list[str], str | None]:
    """A list of tokens, or a mapping {flag: value} (true: a bare flag, a list: several values)."""
    if isinstance(raw, str):
        return raw.split(), None
    if isinstance(raw, list):
        return [str(t) for t in raw], None
    if isinstance(raw, dict):
        out: list[str] = []
        for key, value in raw.items():
            flag = key if str(key).startswith("--") else "--" + str(key).replace("_", "-")
            if value is True:
                out.append(flag)
            elif value is False or value is None:
                continue
            elif isinstance(value, list):
                out += [flag, *map(str, value)]
            else:
                out += [flag, str(value)]
        return out, None
    return [], f"{where}: must be a list of flags or a mapping of flag: value"


def _as_items(raw: Any, items: str, where: str) -> tuple[list[str], str | None]:
    """A list of strings: YAML's list, or one string (mounts: Pyxis's comma-separated list; lines: one line)."""
    if isinstance(raw, list):
        return [str(t) for t in raw], None
    if isinstance(raw, str):
        return ([m for m in raw.split(",") if m] if items == "mounts" else [raw]), None
    return [], f"{where}: must be a list of strings"


def spec_from_dict(data: dict[str, Any]) -> tuple[JobSpec, list[str]]:
    """A spec from a YAML mapping, with one problem per unknown key or bad value."""
    problems: list[str] = []
    spec = JobSpec()
    if not isinstance(data, dict):
        return spec, ["spec: the YAML file must hold a mapping (name: ..., trainer: ..., rollout: ...)"]
    for section, cls in [(None, JobSpec), *SECTIONS.items()]:
        values = data if section is None else data.get(section) or {}
        if not isinstance(values, dict):
            problems.append(f"{section}: must be a mapping of its fields")
            continue
        target = spec if section is None else getattr(spec, section)
        known = {f.name: f for f in dataclasses.fields(cls) if f.name not in SECTIONS}
        for key, raw in values.items():
            if section is None and key in SECTIONS:
                continue
            where = key if section is None else f"{section}.{key}"
            if key not in known:
                close = difflib.get_close_matches(str(key), list(known), n=1)
                problems.append(f"{where}: unknown field" + (f" (did you mean {close[0]}?)" if close else
                                                              f"; known: {', '.join(known)}"))
                continue
            value, problem = _convert(known[key], raw, where)
            if problem:
                problems.append(problem)
            else:
                setattr(target, key, value)
    return spec, problems


# slime's rollout placement flags that are not the spec's own names
_ALIASES = {"--num-gpus-per-node": "--rollout-num-gpus-per-node"}
# slime's --offload (both) and the BooleanOptionalAction negations: flag -> the spec fields it sets
_SWITCHES = {"--offload": (("offload_train", True), ("offload_rollout", True)),
             "--no-offload-train": (("offload_train", False),), "--no-offload-rollout": (("offload_rollout", False),)}
_ROUTED = {"--sglang-router-request-timeout-secs": "the router's --request-timeout-secs (slime's default 14400)",
           "--sglang-server-concurrency": "--rollout-concurrency = N x the number of engines (slime's formula)"}


def slime_flag_routes() -> dict[str, tuple[str, str]]:
    """slime's flags that submit takes itself, not under their spec names: flag -> (refused or
    job spec, what happens). For the flag table (jobs/submit_flags.py)."""
    routes = {flag: ("job spec", f"as {alias}") for flag, alias in _ALIASES.items()}
    routes.update({flag: ("job spec", "sets " + ", ".join(f"rollout.{name}={value}" for name, value in fields))
                   for flag, fields in _SWITCHES.items()})
    routes.update({flag: ("job spec", effect) for flag, effect in _ROUTED.items()})
    return routes


def apply_flags(spec: JobSpec, argv: list[str]) -> list[str]:
    """Apply slime-style flags to spec (in place); problems for bad values. `--sglang-*` and
    `--router-*` go to the passthrough lists, every other unknown flag to the trainer's; then
    slime's own --sglang-* flags are routed (route_slime_sglang_flags)."""
    problems: list[str] = []
    table = spec_flags()
    train, sglang, router = [], [], []
    lines_given: set[str] = set()  # a repeated flag of shell lines adds a line (the first replaces the file's)
    for group in group_flags(argv):
        name = _ALIASES.get(flag_name(group[0]), flag_name(group[0]))
        values = ([group[0].split("=", 1)[1]] if "=" in group[0] else []) + group[1:]
        if not name.startswith("--"):
            problems.append(f"{name}: unexpected argument; flags start with -- (is the spec file first?)")
        elif name in _SWITCHES and not values:
            for field_name, value in _SWITCHES[name]:
                setattr(spec.rollout, field_name, value)
        elif name in table:
            section, f = table[name]
            if str(f.type).startswith("bool") and not values:
                values = ["true"]
            if len(values) != 1:
                # a list of options (steps.ROLE_srun_args): its tokens start with -- and would be flags of their own
                options = str(f.type).startswith("list") and not f.metadata.get("items")
                hint = f"; give the options after '=': {name}='--cpu-bind=none --mem=0'" if options else ""
                problems.append(f"{name}: takes one value, got {len(values)}{hint}")
                continue
            value, problem = _convert(f, values[0], name)
            target = spec if section is None else getattr(spec, section)
            if problem:
                problems.append(problem)
            elif f.metadata.get("items") == "lines" and name in lines_given:
                setattr(target, f.name, getattr(target, f.name) + value)
            else:
                lines_given.add(name)
                setattr(target, f.name, value)
        elif name.startswith("--sglang-"):
            sglang += group
        elif name.startswith("--router-"):
            router += group
        else:
            train += group
    spec.trainer.train_args = merge_flags(spec.trainer.train_args, train)
    spec.rollout.sglang_args = merge_flags(spec.rollout.sglang_args, sglang)
    spec.rollout.router_args = merge_flags(spec.rollout.router_args, router)
    return problems + route_slime_sglang_flags(spec)


def route_slime_sglang_flags(spec: JobSpec) -> list[str]:
    """slime's own --sglang-* flags in rollout.sglang_args (from flags or YAML) are not SGLang's:
    each goes where slurmrl does the same thing (in place), or is refused."""
    r, problems, kept = spec.rollout, [], []
    for group in group_flags(r.sglang_args):
        name = flag_name(group[0])
        values = ([group[0].split("=", 1)[1]] if "=" in group[0] else []) + group[1:]
        number = values[0] if len(values) == 1 and values[0].isdigit() and int(values[0]) > 0 else None
        if name == "--sglang-router-request-timeout-secs":  # slime gives it to the router as its own flag
            if flag_value(r.router_args, "--router-request-timeout-secs") is not None:
                problems.append(f"{name}: the router's --router-request-timeout-secs is given too; give one")
            elif number is None:
                problems.append(f"{' '.join(group)}: needs one whole number of seconds above 0")
            else:
                r.router_args = [*r.router_args, "--router-request-timeout-secs", number]
        elif name == "--sglang-config":  # slime's engine groups YAML, not an SGLang flag (contract/engine_groups.py)
            if len(values) != 1:
                problems.append(f"{name}: takes one value (the YAML file), got {len(values)}")
            else:
                r.sglang_config = values[0]
        elif name == "--sglang-server-concurrency":  # slime: requests in flight per engine
            if flag_value(spec.trainer.train_args, "--rollout-concurrency") is not None:
                problems.append(f"{name}: --rollout-concurrency (requests in flight over all engines) is given "
                                "too; give one")
            elif number is None:
                problems.append(f"{' '.join(group)}: needs one whole number above 0 (requests per engine)")
            else:
                total = int(number) * max(1, r.engine_count)
                spec.trainer.train_args = [*spec.trainer.train_args, "--rollout-concurrency", str(total)]
        else:
            kept += group
    r.sglang_args = kept
    return problems


def load_spec(yaml_path: Path | None, argv: list[str]) -> tuple[JobSpec, list[str]]:
    """The spec of a YAML file (if any) overridden by flags, and every problem seen reading them."""
    problems: list[str] = []
    data: Any = {}
    if yaml_path is not None:
        try:
            data = read_yaml(yaml_path) or {}
        except YamlFileError as err:
            problems.append(f"spec file {yaml_path}: {err}")
    spec, more = spec_from_dict(data)
    problems += more + apply_flags(spec, argv)
    given = {_ALIASES.get(flag_name(group[0]), flag_name(group[0])) for group in group_flags(argv)}
    if spec.rollout.colocate and "--rollout-num-gpus" not in given and "rollout_num_gpus" not in (
            data.get("rollout") or {} if isinstance(data, dict) else {}):
        # slime's: colocated engines given no --rollout-num-gpus take every GPU of the trainer's
        spec.rollout.rollout_num_gpus = spec.trainer.actor_num_nodes * spec.trainer.actor_num_gpus_per_node
    # ${VAR} in train_args and passthrough lists; an unset variable is left as is and reported
    for section, name in (("trainer", "train_args"), ("rollout", "sglang_args"), ("rollout", "router_args"),
                          ("steps", "container_mounts"), *(("steps", f"{role}_srun_args") for role in ROLES)):
        tokens = [os.path.expandvars(t) for t in getattr(getattr(spec, section), name)]
        setattr(getattr(spec, section), name, tokens)
    for where, text in _strings(spec):
        for var in re.findall(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)", text):
            problems.append(f"{where}: ${{{var}}} is not set; export it or give the value as a flag")
    return spec, problems


def _strings(spec: JobSpec) -> list[tuple[str, str]]:
    out = []
    for section, cls in [(None, JobSpec), *SECTIONS.items()]:
        target = spec if section is None else getattr(spec, section)
        for f in dataclasses.fields(cls):
            if f.name in SECTIONS or f.metadata.get("items") == "lines":  # the step's shell expands those
                continue
            value = getattr(target, f.name)
            where = f.name if section is None else f"{section}.{f.name}"
            for text in (value if isinstance(value, list) else [value]):
                if isinstance(text, str):
                    out.append((where, text))
    return out


def spec_from_yaml(text_or_path: str | Path) -> JobSpec:
    """Read a spec (a YAML string or a file path); raises SpecError listing every problem."""
    text = Path(text_or_path).read_text() if isinstance(text_or_path, Path) else text_or_path
    spec, problems = spec_from_dict(yaml.safe_load(text) or {})
    if problems:
        raise SpecError(problems)
    return spec


# -- filling in what the user left out (at submission) -----------------------------------------
JOBS_DIR_ENV = "SLURMRL_JOBS_DIR"


def jobs_root() -> Path:
    """Where job dirs go by default: $SLURMRL_JOBS_DIR, else ~/slurmrl-jobs (a shared home on a
    cluster), never inside the working tree one happens to submit from."""
    return Path(os.environ.get(JOBS_DIR_ENV) or Path.home() / "slurmrl-jobs").expanduser()


def default_job_dir(name: str) -> Path:
    return (jobs_root() / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}").resolve()


def finalize(spec: JobSpec) -> JobSpec:
    """A copy ready to submit: absolute job_dir and paths, the interpreter, and --save/--load
    defaulting to JOB_DIR/checkpoints (so a requeued job resumes from its own saves)."""
    out = dataclasses.replace(spec, trainer=dataclasses.replace(spec.trainer),
                              rollout=dataclasses.replace(spec.rollout),
                              fault_tolerance=dataclasses.replace(spec.fault_tolerance),
                              steps=dataclasses.replace(spec.steps))
    out.job_dir = str(Path(spec.job_dir).expanduser().resolve()) if spec.job_dir else str(default_job_dir(spec.name))
    out.python = spec.python or sys.executable
    args = list(spec.trainer.train_args)
    for flag in PATH_FLAGS:
        value = flag_value(args, flag)
        if value:
            args = set_flag(args, flag, str(Path(value).expanduser().resolve()))
    args = _absolute_eval_paths(args)
    save = flag_value(args, "--save") or str(JobDir(Path(out.job_dir)).checkpoints)
    args = set_flag(args, "--save", save)
    if not flag_value(args, "--load"):
        args = set_flag(args, "--load", save)
    out.trainer.train_args = args
    if out.rollout.sglang_config:
        out.rollout.sglang_config = str(Path(out.rollout.sglang_config).expanduser().resolve())
    problems = engine_groups.resolve(out)  # the config is read here, once: a requeue keeps the groups
    if problems:
        raise SpecError(problems)
    return out


def _absolute_eval_paths(args: list[str]) -> list[str]:
    """--eval-prompt-data NAME PATH [NAME PATH ...] (or a lone PATH) with each PATH made absolute."""
    out = []
    for group in group_flags(args):
        if flag_name(group[0]) == "--eval-prompt-data" and len(group) > 1:
            values = group[1:]
            paths = {0} if len(values) == 1 else set(range(1, len(values), 2))
            values = [str(Path(v).expanduser().resolve()) if i in paths else v for i, v in enumerate(values)]
            group = [group[0], *values]
        out += group
    return out


def read_job_spec(job_dir: str | Path) -> JobSpec:
    """The spec of a job dir (JOB_DIR/spec.yaml), as the supervisor reads it: written by `slurmrl
    submit` (already final), or copied there by a plain-sbatch template (then ${VAR}s are expanded
    from the job's environment and the paths made absolute). Raises SpecError on problems."""
    job_dir = Path(job_dir).resolve()
    spec, problems = load_spec(JobDir(job_dir).spec, [])
    if problems:
        raise SpecError(problems)
    spec.job_dir = str(job_dir)
    return finalize(spec)
