"""The job spec: dataclasses grouped by concern, read from a YAML file and/or slime-style flags
(flags override the file; the reading is contract/spec_loading.py). Torch-free.

YAML shape (every key optional but the trainer's --hf-checkpoint and --num-rollout):

    name: toy                       # SLURM job name
    job_dir: null                   # default $SLURMRL_JOBS_DIR or ~/slurmrl-jobs, then /<name>-<timestamp>
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
      engine: cpu                   # sglang | cpu | standin (the stand-in engine on GPUs, below)
      rollout_num_gpus: 0
      rollout_num_gpus_per_engine: 1
      rollout_num_gpus_per_node: 8
      num_engines: 2                # cpu engine; standin: more than its GPUs shares them
      cpus_per_engine: 2            # cpu engine only
      engines_per_node: 2
      spare_nodes: 0                # extra rollout nodes: an engine whose node fails is relaunched on one
      # An engine spans several nodes when rollout_num_gpus_per_engine > rollout_num_gpus_per_node
      # (whole nodes: a multiple of it), e.g. 16 and 8 = engines of 2 nodes: one srun step per engine,
      # one task per node, SGLang's --nnodes/--node-rank/--dist-init-addr; the router reaches node 0.
      # The cpu engine takes its topology from the same flags (with no GPUs asked for): with
      # engine: cpu, num_engines: 1, rollout_num_gpus_per_engine: 8, rollout_num_gpus_per_node: 4
      # it is one engine of 2 nodes (engines_per_node must stay unset or 1).
      # engine: standin is the stand-in engine (rollout/cpu_engine) on GPUs, where SGLang cannot run:
      # placed as SGLang's engines are (rollout_num_gpus, rollout_num_gpus_per_node; one GPU each),
      # each started with --device cuda on the GPU SLURM binds to its step. With num_engines above
      # rollout_num_gpus the engines of a node share its GPUs (their steps overlap, each takes one
      # by --base-gpu-id); engines sharing a GPU take weights from disk (NCCL refuses two ranks on one GPU).
      sglang_args: [--sglang-mem-fraction-static, "0.8"]
      router_args: []
      colocate: false
      offload_train: null           # null: as colocate (slime's default)
      offload_rollout: null
    fault_tolerance:
      use_fault_tolerance: true
      ...                           # see FaultToleranceSpec: every wait of the job is one of its fields
    steps:                          # how every srun step runs on the site (contract/step_options.py)
      container_image: null         # Pyxis image of every step; trainer_/engine_/router_container_image per role
      container_mounts: [/lustre:/lustre, "/models:/models:ro"]   # SRC:DST[:FLAGS], with an image only
      container_workdir: null       # the steps' working directory inside the container
      container_python: python3     # a containerised step's interpreter (`python` stays the host's)
      engine_srun_args: [--cpu-bind=none]   # extra srun options per role (trainer_, engine_, router_)
      setup: ["module load cuda/12.4", "export NCCL_DEBUG=WARN"]   # shell lines before every step's
                                    # command (trainer_setup, engine_setup, router_setup: one role's, after)
      engine_launch: step           # or node_agent: one step per node runs its engines (hundreds of engines)

Flags: every field has one (`--actor-num-nodes 2`, `--rollout-engine cpu`, `--colocate`, `--job-name`,
`--time`); `--sglang-*` and `--router-*` pass through to the engines and the router; every other flag
is the trainer's (`python -m trainer --help`) and lands in train_args. Strings may use ${ENV} variables.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from contract.bounds import bounded
from contract.job_dir import Phase, write_atomic
from contract.yaml_file import YamlFileError, read_yaml

ENGINES = ("sglang", "cpu", "standin")
GPU_ENGINES = ("sglang", "standin")  # placed on GPUs by the rollout_num_gpus* fields
# Trainer flags naming files or folders: made absolute at submission (the steps run elsewhere).
PATH_FLAGS = ("--hf-checkpoint", "--prompt-data", "--save", "--load", "--ref-load", "--opd-teacher-load",
              "--save-debug-rollout-data", "--load-debug-rollout-data", "--tensorboard-dir", "--custom-config-path",
              "--eval-config")
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

    hf_checkpoint = property(lambda self: flag_value(self.train_args, "--hf-checkpoint"))
    prompt_data = property(lambda self: flag_value(self.train_args, "--prompt-data"))
    save = property(lambda self: flag_value(self.train_args, "--save"))
    load = property(lambda self: flag_value(self.train_args, "--load"))
    ref_load = property(lambda self: flag_value(self.train_args, "--ref-load"))

    @property
    def num_rollout(self) -> int | None:
        value = flag_value(self.train_args, "--num-rollout")
        return int(value) if value is not None and value.isdigit() else None

    @property
    def debug_train_only(self) -> bool:
        """slime's --debug-train-only, which --load-debug-rollout-data sets too (slime's
        arguments.py): the trainer trains on saved rollouts or a rollout function that needs no
        engine, so the job starts no router and no engines."""
        given = {flag_name(g[0]) for g in group_flags(self.train_args)}
        if "--debug-train-only" in given or flag_value(self.train_args, "--load-debug-rollout-data") is not None:
            return True
        return _custom_config_trains_only(flag_value(self.train_args, "--custom-config-path"))


@dataclass
class RolloutSpec:
    engine: str = field(default="sglang", metadata=_flag("--rollout-engine"))
    rollout_num_gpus: int = 8
    rollout_num_gpus_per_engine: int = 1
    rollout_num_gpus_per_node: int = 8
    # the cpu engine's count; the standin engine's where it is more than its GPUs (engines share them)
    num_engines: int | None = field(default=None, metadata=_flag("--rollout-num-engines"))
    cpus_per_engine: int = field(default=2, metadata=_flag("--rollout-cpus-per-engine"))
    engines_per_node: int | None = field(default=None, metadata=_flag("--rollout-engines-per-node"))
    spare_nodes: int = field(default=0, metadata=_flag("--rollout-spare-nodes"))  # beyond num_nodes, idle
    sglang_router_ip: str | None = None
    sglang_router_port: int | None = None
    colocate: bool = False
    prefill_num_servers: int | None = None  # slime's: this many prefill engines, the rest decode
    sglang_config: str | None = None  # slime's SGLang config YAML (engine groups), read at submission
    # resolved groups, `ROLE COUNT [FLAGS]` each (contract/engine_groups.py); empty: all regular
    engine_groups: list[str] = field(default_factory=list, metadata={"flag": None})
    # slime's: None follows --colocate (on with it, off without); --offload sets both
    offload_train: bool | None = None
    offload_rollout: bool | None = None
    sglang_args: list[str] = field(default_factory=list, metadata={"flag": None})
    router_args: list[str] = field(default_factory=list, metadata={"flag": None})

    @property
    def engine_count(self) -> int:
        if self.engine == "cpu":
            return self.num_engines or 0
        own_gpus = self.rollout_num_gpus // max(1, self.rollout_num_gpus_per_engine)
        return (self.num_engines or own_gpus) if self.engine == "standin" else own_gpus

    @property
    def engines_share_gpus(self) -> bool:
        """Stand-in engines beyond one per GPU: a node's engines share its GPUs."""
        own_gpus = self.rollout_num_gpus // max(1, self.rollout_num_gpus_per_engine)
        return self.engine == "standin" and self.engine_count > own_gpus

    @property
    def gpus_per_engine_step(self) -> int:
        """GPUs each engine's step binds on each of its nodes: none for the cpu engine, the node's
        rollout GPUs for stand-in engines that share them (each takes one by --base-gpu-id), else
        its own."""
        if self.engine == "cpu":
            return 0
        if self.engines_share_gpus:
            return self.gpus_per_node
        return min(self.rollout_num_gpus_per_engine, self.rollout_num_gpus_per_node)

    @property
    def nodes_per_engine(self) -> int:
        """Nodes one engine spans: more than 1 when an engine needs more GPUs than a node has (the
        cpu engine takes its topology from the same flags)."""
        per_engine, per_node = self.rollout_num_gpus_per_engine, max(1, self.rollout_num_gpus_per_node)
        return max(1, per_engine // per_node) if per_engine > per_node else 1

    @property
    def gpus_per_node(self) -> int:
        """GPUs asked for on each rollout node (0 for the CPU engine)."""
        if self.engine == "cpu":
            return 0
        return min(self.rollout_num_gpus, self.rollout_num_gpus_per_node)

    @property
    def engines_on_each_node(self) -> int:
        """Engines (or, for a multi-node engine, engine processes) per rollout node."""
        if self.engine == "cpu" and self.nodes_per_engine == 1:
            return max(1, min(self.engines_per_node or self.engine_count, self.engine_count or 1))
        if self.engines_share_gpus:
            return -(-self.engine_count // self.num_nodes)
        return max(1, self.gpus_per_node // max(1, self.rollout_num_gpus_per_engine))

    @property
    def num_nodes(self) -> int:
        """Nodes the engines are placed on (spare_nodes come on top)."""
        if self.engine == "cpu" and self.nodes_per_engine > 1:
            return max(1, self.engine_count) * self.nodes_per_engine
        if self.engine == "cpu":
            return -(-max(1, self.engine_count) // self.engines_on_each_node)
        return -(-max(1, self.rollout_num_gpus) // max(1, self.rollout_num_gpus_per_node))

    @property
    def offloads_train(self) -> bool:
        """The trainer moves weights, grads and optimizer state to the host around rollouts."""
        return self.colocate if self.offload_train is None else self.offload_train

    @property
    def offloads_rollout(self) -> bool:
        """The engines release their memory (weights, KV cache) around training."""
        return self.colocate if self.offload_rollout is None else self.offload_rollout

    @property
    def external_router(self) -> bool:
        return bool(self.sglang_router_ip)


@dataclass
class FaultToleranceSpec:
    """What the supervisor does about failures, and every wait of the job. Each number carries its
    unit and the values it accepts (contract/bounds.py's Bound, in the field's metadata; validation
    iterates over them) and bounds what its comment says."""

    use_fault_tolerance: bool = False
    # after an engine's launch: failed probes do not count yet
    rollout_health_check_first_wait: float = bounded(300.0, "s", 0)
    # between two probe cycles of every engine (a suspect one: see HealthTracker.next_cycle)
    rollout_health_check_interval: float = bounded(10.0, "s", 0.1)
    rollout_health_check_timeout: float = bounded(5.0, "s", 0.1)   # one /health_generate probe (and /model_info)
    health_check_failure_threshold: int = bounded(3, "count", 1)   # failed probes in a row that make an engine failed
    # per engine, in a row, before the crash-loop breaker gives up on it
    max_engine_restarts: int = bounded(5, "count", 0)
    restart_backoff: float = bounded(5.0, "s", 0)      # before the second restart of a crash loop; doubles each time
    # a restart this soon after the previous one continues a crash loop
    crash_window: float = bounded(300.0, "s", 0)
    # of the engines, at most killed for failed probes per interval
    max_kill_fraction: float = bounded(0.5, "fraction", 0, high=1, low_open=True)
    # SLURM sends USR1 this long before the end (issue 7); the job begins to stop then, or earlier
    # when a save takes longer (supervisor/deadline.py)
    preempt_grace: int = bounded(600, "s", 1)
    max_requeues: int = bounded(3, "count", 0)
    max_trainer_restarts: int = bounded(3, "count", 0)
    min_engines: int = bounded(1, "count", 0)          # fewer live engines than this: requeue instead of degrading
    # Seconds the trainer may stay in one phase without a new heartbeat before it counts as hung
    # and its step is restarted (start: from launch to its first heartbeat, e.g. loading weights;
    # save: without progress, as a save beats again at each file written or fsync'd).
    trainer_start_timeout: float = bounded(1800.0, "s", 1)
    trainer_rollout_timeout: float = bounded(3600.0, "s", 1)
    trainer_train_timeout: float = bounded(1800.0, "s", 1)   # per optimizer step
    trainer_publish_timeout: float = bounded(900.0, "s", 1)
    trainer_save_timeout: float = bounded(1800.0, "s", 1)
    # Engines relaunched behind an update group's weight version (on no disk) wait for the trainer's next publish,
    # while no engine serves and the trainer waits in its rollout: past this the trainer saves now and is restarted
    # (not at once: a rollout whose generation was done may still be scoring its samples, and then publishes itself)
    engine_stranded_timeout: float = bounded(60.0, "s", 0.1)
    # Starting and stopping steps
    router_start_timeout: float = bounded(60.0, "s", 0.1)      # the router's launch until it answers
    # an engine's (re)launch until it answers /health_generate
    engine_start_timeout: float = bounded(300.0, "s", 0.1)
    # a recovered engine until the router lists it (else reported out)
    engine_admit_timeout: float = bounded(120.0, "s", 0.1)
    weight_load_timeout: float = bounded(600.0, "s", 0.1)      # one /update_weights_from_disk of a recovering engine
    step_stop_timeout: float = bounded(30.0, "s", 0.1)         # scancel of a step until SLURM no longer lists it
    step_term_grace: float = bounded(5.0, "s", 0.1)            # SIGTERM to SIGKILL when a step is stopped
    # for slurmdbd to record the exit code of a step that ended unseen
    step_exit_code_wait: float = bounded(30.0, "s", 0.1)
    # Talking to SLURM, the router and the control socket
    slurm_command_timeout: float = bounded(30.0, "s", 0.1)     # one scontrol/squeue/scancel/sacct call
    node_check_interval: float = bounded(15.0, "s", 0.1)       # between two checks of every engine and spare node
    # node checks while an engine's step is stopped or (re)started
    node_poll_interval: float = bounded(1.0, "s", 0.1)
    # asking SLURM, after a requeue, to exclude the lost nodes
    exclude_timeout: float = bounded(20.0, "s", 0.1)
    router_request_timeout: float = bounded(10.0, "s", 0.1)    # one call to the router's worker API
    control_call_timeout: float = bounded(30.0, "s", 0.1)      # one call on the control socket (CLI, trainer)
    # the trainer's calls wait this long for a restarted supervisor
    supervisor_gap: float = bounded(120.0, "s", 0.1)

    def phase_timeout(self, phase: Phase | str) -> float:
        """The heartbeat timeout of a trainer phase; ValueError for a phase that does not exist."""
        return {Phase.START: self.trainer_start_timeout, Phase.ROLLOUT: self.trainer_rollout_timeout,
                Phase.TRAIN: self.trainer_train_timeout, Phase.PUBLISH: self.trainer_publish_timeout,
                Phase.SAVE: self.trainer_save_timeout}[Phase(phase)]


ROLES = ("trainer", "engine", "router")  # the kinds of srun step the supervisor launches
ENGINE_LAUNCHES = ("step", "node_agent")  # StepsSpec.engine_launch: a step per engine, or an agent per node


def _lines(flag: str) -> dict[str, str]:
    """Field metadata of a list of shell lines: each --flag gives one line, run by the step's shell
    (so its $VARs are the step's, not expanded at submission)."""
    return {"flag": flag, "items": "lines"}


@dataclass
class StepsSpec:
    """How every srun step runs on the site: in a container through Pyxis (one image per role, the
    default image for the roles without one), with extra srun options per role, after shell setup
    lines (module loads, exports). Rendered and checked by contract/step_options.py."""

    container_image: str | None = None
    trainer_container_image: str | None = None
    engine_container_image: str | None = None
    router_container_image: str | None = None
    container_mounts: list[str] = field(default_factory=list, metadata={"items": "mounts"})  # SRC:DST[:FLAGS]
    container_workdir: str | None = None
    container_python: str = "python3"  # the interpreter of a step in a container (slurmrl installed there)
    trainer_srun_args: list[str] = field(default_factory=list)
    engine_srun_args: list[str] = field(default_factory=list)
    router_srun_args: list[str] = field(default_factory=list)
    setup: list[str] = field(default_factory=list, metadata=_lines("--step-setup"))  # every step's
    trainer_setup: list[str] = field(default_factory=list, metadata=_lines("--trainer-setup"))
    engine_setup: list[str] = field(default_factory=list, metadata=_lines("--engine-setup"))
    router_setup: list[str] = field(default_factory=list, metadata=_lines("--router-setup"))
    # How engines are launched: "step" (one srun step each; every relaunch a new step) or
    # "node_agent" (one step per node whose agent starts, watches and restarts that node's engines:
    # one srun client per node on the head node, no step per restart; supervisor/node_agents.py).
    # Engines over several nodes, and --colocate's, are steps of their own either way.
    engine_launch: str = "step"  # one of ENGINE_LAUNCHES

    def image(self, role: str) -> str | None:
        own = getattr(self, f"{role}_container_image")
        return self.container_image if own is None else own

    def srun_args(self, role: str) -> list[str]:
        return list(getattr(self, f"{role}_srun_args"))

    def setup_lines(self, role: str) -> list[str]:
        return [*self.setup, *getattr(self, f"{role}_setup")]


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
    steps: StepsSpec = field(default_factory=StepsSpec)

    # -- YAML (the job dir keeps spec.yaml; contract/spec_loading.py reads it back) --
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=None, width=120)

    def write(self, path: Path) -> Path:
        return write_atomic(path, self.to_yaml())

    @property
    def time_minutes(self) -> int | None:
        return parse_slurm_time(self.time)

    @property
    def starts_engines(self) -> bool:
        """False with --debug-train-only: no rollout group, router, engine step or engine check."""
        return not self.trainer.debug_train_only

    @property
    def het_groups(self) -> int:
        return 2 if self.starts_engines and not self.rollout.colocate else 1

    @property
    def rollout_group(self) -> int:
        """The het group the engines run in: 1, or 0 with --colocate (and without engines)."""
        return self.het_groups - 1


SECTIONS = {"trainer": TrainerSpec, "rollout": RolloutSpec, "fault_tolerance": FaultToleranceSpec,
            "steps": StepsSpec}


# -- flag tokens --------------------------------------------------------------------------------
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


def flag_name(token: str) -> str:
    return token.split("=", 1)[0]


def _custom_config_trains_only(path: str | None) -> bool:
    """Whether --custom-config-path's YAML, whose keys the trainer sets on its flags
    (trainer/custom_config.py), sets debug_train_only or load_debug_rollout_data. A file that cannot
    be read is named by the trainer's own check of the flags at submission."""
    if path is None:
        return False
    try:
        return _yaml_trains_only(Path(path), Path(path).stat().st_mtime_ns)
    except (OSError, YamlFileError):
        return False


@functools.lru_cache(maxsize=8)
def _yaml_trains_only(path: Path, mtime_ns: int) -> bool:
    """Read once per version of the file: a submission asks the spec about a dozen times."""
    data = read_yaml(path)
    return isinstance(data, dict) and (bool(data.get("debug_train_only")) or
                                       data.get("load_debug_rollout_data") is not None)


def flag_value(argv: list[str], flag: str) -> str | None:
    """The (last) value of `flag` in argv, None when absent or valueless."""
    value = None
    for group in group_flags(argv):
        if flag_name(group[0]) == flag:
            value = group[0].split("=", 1)[1] if "=" in group[0] else (group[1] if len(group) > 1 else None)
    return value


def merge_flags(base: list[str], override: list[str]) -> list[str]:
    """base's flags, each replaced by override's flag of the same name; override's new flags appended."""
    names = {flag_name(g[0]) for g in group_flags(override)}
    kept = [t for g in group_flags(base) if flag_name(g[0]) not in names for t in g]
    return kept + list(override)


def set_flag(argv: list[str], flag: str, value: str) -> list[str]:
    """argv with `flag value` in place of flag's (every) occurrence, or appended."""
    groups = [[flag, value] if flag_name(g[0]) == flag else g for g in group_flags(argv)]
    out = [t for g in groups for t in g]
    return out if flag in out else out + [flag, value]


# -- SLURM time strings -----------------------------------------------------------------------
_TIME = re.compile(r"^(?:(?P<d>\d+)-(?P<dh>\d+)(?::(?P<dm>\d+)(?::(?P<ds>\d+))?)?"
                   r"|(?P<a>\d+)(?::(?P<b>\d+)(?::(?P<c>\d+))?)?)$")


def parse_slurm_time(value: str | int) -> int | None:
    """Minutes (rounded up) of a SLURM time string: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S; None if malformed."""
    m = _TIME.match(str(value).strip())
    if not m:
        return None
    g = {k: int(v) for k, v in m.groupdict().items() if v is not None}  # the groups matched
    if "d" in g:
        seconds = g["d"] * 86400 + g["dh"] * 3600 + g.get("dm", 0) * 60 + g.get("ds", 0)
    elif "c" in g:
        seconds = g["a"] * 3600 + g["b"] * 60 + g["c"]
    elif "b" in g:
        seconds = g["a"] * 60 + g["b"]
    else:
        seconds = g["a"] * 60
    return -(-seconds // 60)
