"""The job spec: dataclasses read from a YAML file and/or slime-style flags (flags override the file).

YAML shape (every key optional but the trainer's --hf-checkpoint and --num-rollout):

    name: toy                       # SLURM job name
    job_dir: null                   # default ./slurmrl-jobs/<name>-<timestamp> (made absolute)
    partition: dev
    account: null
    qos: null
    time: "00:30:00"                # SLURM time string
    exclude: null                   # nodes to avoid, e.g. node[3-4]
    python: null                    # interpreter of every step (default: the submitting one)
    trainer:
      actor_num_nodes: 1
      actor_num_gpus_per_node: 0    # 0: CPU workers, actor_num_cpu_workers tasks per node
      actor_num_cpu_workers: 1
      cpus_per_task: 2
      train_args: [--hf-checkpoint, /models/qwen, --num-rollout, "20"]   # or a mapping:
      # train_args: {hf-checkpoint: /models/qwen, num-rollout: 20, apply-chat-template: true}
    rollout:
      engine: cpu                   # sglang | cpu
      rollout_num_gpus: 0
      rollout_num_gpus_per_engine: 1
      rollout_num_gpus_per_node: 8
      num_engines: 2                # cpu engine only
      cpus_per_engine: 2            # cpu engine only
      engines_per_node: 2
      spare_nodes: 0                # extra rollout nodes: an engine whose node fails is relaunched on one
      sglang_args: [--sglang-mem-fraction-static, "0.8"]
      router_args: []
      colocate: false
    fault_tolerance:
      use_fault_tolerance: true
      ...                           # see FaultToleranceSpec

Flags: every field has one (`--actor-num-nodes 2`, `--rollout-engine cpu`, `--colocate`, `--job-name`,
`--time`); `--sglang-*` and `--router-*` pass through to the engines and the router; every other flag
is the trainer's (`python -m trainer --help`) and lands in train_args. Strings may use ${ENV} variables.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import sys
import tempfile
import time as _time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

if TYPE_CHECKING:
    from jobs.hetjob import HetGroup

ENGINES = ("sglang", "cpu")
# Trainer flags naming files or folders: made absolute at submission (the steps run elsewhere).
PATH_FLAGS = ("--hf-checkpoint", "--prompt-data", "--save", "--load", "--ref-load", "--opd-teacher-load",
              "--save-debug-rollout-data", "--load-debug-rollout-data", "--tensorboard-dir")
# Trainer flags slurmrl sets itself on the trainer step.
OWNED_TRAIN_FLAGS = ("--job-dir", "--supervised", "--sglang-router-ip", "--sglang-router-port",
                     "--engine-urls", "--master-port")


class SpecError(ValueError):
    """The spec has problems; `problems` holds one line per problem (field, what is wrong, the fix)."""

    def __init__(self, problems: list[str]):
        super().__init__("\n".join(problems))
        self.problems = problems


def _flag(flag: str) -> dict[str, str]:
    """Field metadata: the field's flag, where it is not --FIELD-NAME."""
    return {"flag": flag}


@dataclass
class TrainerSpec:
    actor_num_nodes: int = 1
    actor_num_gpus_per_node: int = 8
    actor_num_cpu_workers: int = 1
    cpus_per_task: int = field(default=4, metadata=_flag("--actor-cpus-per-task"))
    train_args: list[str] = field(default_factory=list, metadata={"flag": None})

    @property
    def tasks_per_node(self) -> int:
        """Trainer processes per node: one per GPU, or the CPU workers."""
        return self.actor_num_gpus_per_node or self.actor_num_cpu_workers

    def arg(self, name: str) -> Any:
        """The value of one trainer flag (`arg("hf_checkpoint")`) as the trainer will parse it (its
        default when absent); None when train_args do not parse."""
        from trainer.args import ArgsError, build_parser

        try:
            parsed, _ = build_parser().parse_known_args(self.train_args)
        except ArgsError:
            return None
        return getattr(parsed, name, None)

    hf_checkpoint = property(lambda self: flag_value(self.train_args, "--hf-checkpoint"))
    prompt_data = property(lambda self: flag_value(self.train_args, "--prompt-data"))
    save = property(lambda self: flag_value(self.train_args, "--save"))
    load = property(lambda self: flag_value(self.train_args, "--load"))
    ref_load = property(lambda self: flag_value(self.train_args, "--ref-load"))

    @property
    def num_rollout(self) -> int | None:
        value = flag_value(self.train_args, "--num-rollout")
        return int(value) if value is not None and value.isdigit() else None


@dataclass
class RolloutSpec:
    engine: str = field(default="sglang", metadata=_flag("--rollout-engine"))
    rollout_num_gpus: int = 8
    rollout_num_gpus_per_engine: int = 1
    rollout_num_gpus_per_node: int = 8
    num_engines: int | None = field(default=None, metadata=_flag("--rollout-num-engines"))  # cpu engine
    cpus_per_engine: int = field(default=2, metadata=_flag("--rollout-cpus-per-engine"))
    engines_per_node: int | None = field(default=None, metadata=_flag("--rollout-engines-per-node"))
    spare_nodes: int = field(default=0, metadata=_flag("--rollout-spare-nodes"))  # beyond num_nodes, idle
    sglang_router_ip: str | None = None
    sglang_router_port: int | None = None
    colocate: bool = False
    sglang_args: list[str] = field(default_factory=list, metadata={"flag": None})
    router_args: list[str] = field(default_factory=list, metadata={"flag": None})

    @property
    def engine_count(self) -> int:
        if self.engine == "cpu":
            return self.num_engines or 0
        return self.rollout_num_gpus // max(1, self.rollout_num_gpus_per_engine)

    @property
    def gpus_per_node(self) -> int:
        """GPUs asked for on each rollout node (0 for the CPU engine)."""
        if self.engine == "cpu":
            return 0
        return min(self.rollout_num_gpus, self.rollout_num_gpus_per_node)

    @property
    def engines_on_each_node(self) -> int:
        """Engines (or, for a multi-node engine, engine processes) per rollout node."""
        if self.engine == "cpu":
            return max(1, min(self.engines_per_node or self.engine_count, self.engine_count or 1))
        return max(1, self.gpus_per_node // max(1, self.rollout_num_gpus_per_engine))

    @property
    def num_nodes(self) -> int:
        """Nodes the engines are placed on (spare_nodes come on top)."""
        if self.engine == "cpu":
            return -(-max(1, self.engine_count) // self.engines_on_each_node)
        return -(-max(1, self.rollout_num_gpus) // max(1, self.rollout_num_gpus_per_node))

    @property
    def external_router(self) -> bool:
        return bool(self.sglang_router_ip)


TRAINER_PHASES = ("start", "rollout", "train", "publish", "save")  # as trainer/metrics.py beats them


@dataclass
class FaultToleranceSpec:
    use_fault_tolerance: bool = False
    rollout_health_check_first_wait: float = 300.0
    rollout_health_check_interval: float = 10.0
    rollout_health_check_timeout: float = 5.0
    health_check_failure_threshold: int = 3
    max_engine_restarts: int = 5        # per engine, before the crash-loop breaker gives up on it
    restart_backoff: float = 5.0        # seconds before the first restart; doubles each time
    max_kill_fraction: float = 0.5      # of the engines, at most killed for failed probes per interval
    preempt_grace: int = 600            # seconds: SLURM sends USR1 this long before the end (issue 7)
    max_requeues: int = 3
    max_trainer_restarts: int = 3
    min_engines: int = 1                # fewer live engines than this: requeue instead of degrading
    # Seconds the trainer may stay in one phase without a new heartbeat before it counts as hung
    # and its step is restarted (start: from launch to its first heartbeat, e.g. loading weights).
    trainer_start_timeout: float = 1800.0
    trainer_rollout_timeout: float = 3600.0
    trainer_train_timeout: float = 1800.0   # per optimizer step
    trainer_publish_timeout: float = 900.0
    trainer_save_timeout: float = 1800.0

    def phase_timeout(self, phase: str) -> float:
        """The heartbeat timeout of a trainer phase (start, rollout, train, publish, save)."""
        return float(getattr(self, f"trainer_{phase}_timeout", self.trainer_start_timeout))


@dataclass
class JobSpec:
    name: str = field(default="slurmrl", metadata=_flag("--job-name"))
    job_dir: str | None = None
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    time: str = "01:00:00"
    exclude: str | None = None
    python: str | None = None
    trainer: TrainerSpec = field(default_factory=TrainerSpec)
    rollout: RolloutSpec = field(default_factory=RolloutSpec)
    fault_tolerance: FaultToleranceSpec = field(default_factory=FaultToleranceSpec)

    # -- YAML round trip (the job dir keeps spec.yaml; the supervisor reads it) --
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=None, width=120)

    @classmethod
    def from_yaml(cls, text_or_path: str | Path) -> JobSpec:
        """Read a spec (a YAML string or a file path); raises SpecError listing every problem."""
        text = Path(text_or_path).read_text() if isinstance(text_or_path, Path) else text_or_path
        spec, problems = spec_from_dict(yaml.safe_load(text) or {})
        if problems:
            raise SpecError(problems)
        return spec

    def write(self, path: Path) -> Path:
        return write_atomic(path, self.to_yaml())

    @property
    def time_minutes(self) -> int | None:
        return parse_slurm_time(self.time)

    @property
    def het_groups(self) -> int:
        return 1 if self.rollout.colocate else 2

    @property
    def rollout_group(self) -> int:
        """The het group the engines run in: 1, or 0 with --colocate."""
        return 0 if self.rollout.colocate else 1

    def groups(self) -> list[HetGroup]:
        """The het groups to ask SLURM for: 0 = trainer nodes (the batch step, i.e. the supervisor,
        runs on its first node), 1 = rollout nodes (absent with --colocate: the engines share
        group 0's nodes and GPUs, their tasks added to group 0's)."""
        from jobs.hetjob import HetGroup

        t, r = self.trainer, self.rollout
        common = {"partition": self.partition, "account": self.account, "qos": self.qos,
                  "time_min": self.time_minutes, "exclude": self.exclude}
        if r.colocate:
            per_node = -(-r.engine_count // max(1, t.actor_num_nodes))
            cpus = max(t.cpus_per_task, r.cpus_per_engine)
            return [HetGroup(nodes=t.actor_num_nodes, ntasks_per_node=t.tasks_per_node + per_node, cpus_per_task=cpus,
                             gpus_per_node=t.actor_num_gpus_per_node, **common)]
        return [HetGroup(nodes=t.actor_num_nodes, ntasks_per_node=t.tasks_per_node, cpus_per_task=t.cpus_per_task,
                         gpus_per_node=t.actor_num_gpus_per_node, **common),
                HetGroup(nodes=r.num_nodes + r.spare_nodes, ntasks_per_node=r.engines_on_each_node,
                         cpus_per_task=r.cpus_per_engine, gpus_per_node=r.gpus_per_node, **common)]


def write_atomic(path: Path, text: str) -> Path:
    """A reader sees the old file or the whole new one, never half of it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


SECTIONS = {"trainer": TrainerSpec, "rollout": RolloutSpec, "fault_tolerance": FaultToleranceSpec}


# -- flags ------------------------------------------------------------------------------------
def _fields(cls: type) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if f.name not in SECTIONS and f.metadata.get("flag", "") is not None]


def spec_flags() -> dict[str, tuple[str | None, dataclasses.Field]]:
    """`--flag` -> (section or None for the top level, field) for every spec field that has a flag."""
    out: dict[str, tuple[str | None, dataclasses.Field]] = {}
    for section, cls in [(None, JobSpec), *SECTIONS.items()]:
        for f in _fields(cls):
            out[f.metadata.get("flag") or "--" + f.name.replace("_", "-")] = (section, f)
    return out


def group_flags(argv: list[str]) -> list[list[str]]:
    """[--a, 1, --b, --c=2, x] -> [[--a, 1], [--b], [--c=2, x]]: each flag with the values after it.
    A token before any flag becomes its own group."""
    groups: list[list[str]] = []
    for token in argv:
        if token.startswith("--") or not groups:
            groups.append([token])
        else:
            groups[-1].append(token)
    return groups


def _flag_name(token: str) -> str:
    return token.split("=", 1)[0]


def flag_value(argv: list[str], flag: str) -> str | None:
    """The (last) value of `flag` in argv, None when absent or valueless."""
    value = None
    for group in group_flags(argv):
        if _flag_name(group[0]) == flag:
            value = group[0].split("=", 1)[1] if "=" in group[0] else (group[1] if len(group) > 1 else None)
    return value


def merge_flags(base: list[str], override: list[str]) -> list[str]:
    """base's flags, each replaced by override's flag of the same name; override's new flags appended."""
    names = {_flag_name(g[0]) for g in group_flags(override)}
    kept = [t for g in group_flags(base) if _flag_name(g[0]) not in names for t in g]
    return kept + list(override)


def set_flag(argv: list[str], flag: str, value: str) -> list[str]:
    """argv with `flag value` in place of flag's (every) occurrence, or appended."""
    groups = [[flag, value] if _flag_name(g[0]) == flag else g for g in group_flags(argv)]
    out = [t for g in groups for t in g]
    return out if flag in out else out + [flag, value]


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


def apply_flags(spec: JobSpec, argv: list[str]) -> list[str]:
    """Apply slime-style flags to spec (in place); problems for bad values. `--sglang-*` and
    `--router-*` go to the passthrough lists, every other unknown flag to the trainer's."""
    problems: list[str] = []
    table = spec_flags()
    train, sglang, router = [], [], []
    for group in group_flags(argv):
        name = _flag_name(group[0])
        values = ([group[0].split("=", 1)[1]] if "=" in group[0] else []) + group[1:]
        if not name.startswith("--"):
            problems.append(f"{name}: unexpected argument; flags start with -- (is the spec file first?)")
        elif name in table:
            section, f = table[name]
            if str(f.type).startswith("bool") and not values:
                values = ["true"]
            if len(values) != 1:
                problems.append(f"{name}: takes one value, got {len(values)}")
                continue
            value, problem = _convert(f, values[0], name)
            if problem:
                problems.append(problem)
            else:
                setattr(spec if section is None else getattr(spec, section), f.name, value)
        elif name.startswith("--sglang-"):
            sglang += group
        elif name.startswith("--router-"):
            router += group
        else:
            train += group
    spec.trainer.train_args = merge_flags(spec.trainer.train_args, train)
    spec.rollout.sglang_args = merge_flags(spec.rollout.sglang_args, sglang)
    spec.rollout.router_args = merge_flags(spec.rollout.router_args, router)
    return problems


def load_spec(yaml_path: Path | None, argv: list[str]) -> tuple[JobSpec, list[str]]:
    """The spec of a YAML file (if any) overridden by flags, and every problem seen reading them."""
    problems: list[str] = []
    data: Any = {}
    if yaml_path is not None:
        try:
            data = yaml.safe_load(yaml_path.read_text()) or {}
        except FileNotFoundError:
            problems.append(f"spec file {yaml_path}: does not exist")
        except (OSError, yaml.YAMLError) as err:
            problems.append(f"spec file {yaml_path}: cannot be read as YAML ({str(err).splitlines()[0]})")
    spec, more = spec_from_dict(data)
    problems += more + apply_flags(spec, argv)
    # ${VAR} in train_args and passthrough lists; an unset variable is left as is and reported
    for section, name in (("trainer", "train_args"), ("rollout", "sglang_args"), ("rollout", "router_args")):
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
            if f.name in SECTIONS:
                continue
            value = getattr(target, f.name)
            where = f.name if section is None else f"{section}.{f.name}"
            for text in (value if isinstance(value, list) else [value]):
                if isinstance(text, str):
                    out.append((where, text))
    return out


# -- SLURM time strings -----------------------------------------------------------------------
_TIME = re.compile(r"^(?:(?P<d>\d+)-(?P<dh>\d+)(?::(?P<dm>\d+)(?::(?P<ds>\d+))?)?"
                   r"|(?P<a>\d+)(?::(?P<b>\d+)(?::(?P<c>\d+))?)?)$")


def parse_slurm_time(value: str | int) -> int | None:
    """Minutes (rounded up) of a SLURM time string: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S; None if malformed."""
    m = _TIME.match(str(value).strip())
    if not m:
        return None
    g = {k: int(v) if v is not None else None for k, v in m.groupdict().items()}
    if g["d"] is not None:
        seconds = g["d"] * 86400 + g["dh"] * 3600 + (g["dm"] or 0) * 60 + (g["ds"] or 0)
    elif g["c"] is not None:
        seconds = g["a"] * 3600 + g["b"] * 60 + g["c"]
    elif g["b"] is not None:
        seconds = g["a"] * 60 + g["b"]
    else:
        seconds = g["a"] * 60
    return -(-seconds // 60)


# -- filling in what the user left out (at submission) -----------------------------------------
def default_job_dir(name: str) -> Path:
    return Path("slurmrl-jobs", f"{name}-{_time.strftime('%Y%m%d-%H%M%S')}").resolve()


def finalize(spec: JobSpec) -> JobSpec:
    """A copy ready to submit: absolute job_dir and paths, the interpreter, and --save/--load
    defaulting to JOB_DIR/checkpoints (so a requeued job resumes from its own saves)."""
    out = dataclasses.replace(spec, trainer=dataclasses.replace(spec.trainer),
                              rollout=dataclasses.replace(spec.rollout),
                              fault_tolerance=dataclasses.replace(spec.fault_tolerance))
    out.job_dir = str(Path(spec.job_dir).expanduser().resolve()) if spec.job_dir else str(default_job_dir(spec.name))
    out.python = spec.python or sys.executable
    args = list(spec.trainer.train_args)
    for flag in PATH_FLAGS:
        value = flag_value(args, flag)
        if value:
            args = set_flag(args, flag, str(Path(value).expanduser().resolve()))
    save = flag_value(args, "--save") or str(Path(out.job_dir, "checkpoints"))
    args = set_flag(args, "--save", save)
    if not flag_value(args, "--load"):
        args = set_flag(args, "--load", save)
    out.trainer.train_args = args
    return out


def read_job_spec(job_dir: str | Path) -> JobSpec:
    """The spec of a job dir (JOB_DIR/spec.yaml), as the supervisor reads it: written by `slurmrl
    submit` (already final), or copied there by a plain-sbatch template (then ${VAR}s are expanded
    from the job's environment and the paths made absolute). Raises SpecError on problems."""
    job_dir = Path(job_dir).resolve()
    spec, problems = load_spec(job_dir / "spec.yaml", [])
    if problems:
        raise SpecError(problems)
    spec.job_dir = str(job_dir)
    return finalize(spec)
