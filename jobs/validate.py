"""Validation of a job spec before anything is submitted or written (invariant 7): every problem
is one line naming the field and the fix; all of them are collected, none raised one at a time."""

from __future__ import annotations

import dataclasses
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from contract import bounds, engine_groups, step_options
from contract.spec import ENGINES, GPU_ENGINES, JobSpec, RolloutSpec, flag_value
from jobs.hetjob import het_groups
from jobs.trainer_flags import train_args_problems
from slurm.client import SlurmClient
from slurm.configuration import configuration_problem


@dataclass(frozen=True)
class PartitionInfo:
    name: str
    nodes: int
    cpus_per_node: int
    gpus_per_node: int


def query_partitions(timeout_s: float) -> dict[str, PartitionInfo] | None:
    """Partitions as sinfo sees them (one call), with the default one also under ""; None when
    SLURM does not answer (no sinfo, no controller, no configuration): the capacity checks are then
    skipped."""
    if configuration_problem() is not None:
        return None  # nothing to ask (SLURM's programs retry a missing SLURM_CONF for a minute); submit says why
    out = SlurmClient(timeout_s).call("sinfo", "-h", "-N", "-o", "%N|%P|%c|%G")
    if not out.ok:
        return None
    nodes: dict[str, dict[str, tuple[int, int]]] = {}
    default = None
    for line in out.stdout.splitlines():
        parts = line.split("|")
        if len(parts) != 4:
            continue
        node, part, cpus, gres = parts
        if part.endswith("*"):
            part = default = part[:-1]
        gpus = max((int(m) for m in re.findall(r"gpu(?::[^:(,]+)?:(\d+)", gres)), default=0)
        nodes.setdefault(part, {})[node] = (int(cpus.rstrip("+") or 0), gpus)
    infos = {p: PartitionInfo(p, len(n), max(c for c, _ in n.values()), max(g for _, g in n.values()))
             for p, n in nodes.items()}
    if default:
        infos[""] = infos[default]
    return infos


def _rollout_problems(spec: JobSpec) -> list[str]:
    from rollout.launch import (
        EngineLaunch,
        LaunchError,
        RouterLaunch,
        passthrough,
        router_command,
    )

    r, t = spec.rollout, spec.trainer
    problems: list[str] = []
    if r.engine not in ENGINES:
        problems.append(f"rollout.engine: {r.engine!r} is not one of {', '.join(ENGINES)}")
    elif r.engine in GPU_ENGINES:
        g, tp_, per_node = r.rollout_num_gpus, r.rollout_num_gpus_per_engine, r.rollout_num_gpus_per_node
        if g < 1 or tp_ < 1 or per_node < 1:
            problems.append("rollout: rollout_num_gpus, rollout_num_gpus_per_engine and rollout_num_gpus_per_node "
                            f"must be 1 or more for the {r.engine} engine (or use --rollout-engine cpu)")
        elif g % tp_:
            problems.append(f"rollout.rollout_num_gpus: {g} is not a multiple of rollout_num_gpus_per_engine {tp_}; "
                            f"give --rollout-num-gpus {max(tp_, g - g % tp_)}")
        elif g > per_node and g % per_node:
            problems.append(f"rollout.rollout_num_gpus: {g} does not fill whole nodes of {per_node} GPUs "
                            f"(rollout_num_gpus_per_node); give a multiple of {per_node}")
        elif (tp_ <= per_node and per_node % tp_) or (tp_ > per_node and tp_ % per_node):
            problems.append(f"rollout.rollout_num_gpus_per_engine: {tp_} does not tile nodes of {per_node} GPUs; "
                            f"an engine must fit a node evenly or span whole nodes: give a divisor or a "
                            f"multiple of {per_node}")
        elif r.engine == "standin":
            problems += _standin_problems(spec)
    else:
        problems += _cpu_topology_problems(r)
        if not r.num_engines or r.num_engines < 1:
            problems.append("rollout.num_engines: the cpu engine needs --rollout-num-engines 1 or more")
        if r.cpus_per_engine < 1:
            problems.append("rollout.cpus_per_engine: must be 1 or more")
        if r.engines_per_node is not None and r.engines_per_node < 1:
            problems.append("rollout.engines_per_node: must be 1 or more")
        device = flag_value(r.sglang_args, "--sglang-device")
        if device not in (None, "cpu"):
            problems.append(f"rollout.sglang_args: --sglang-device {device}, but the cpu engine's steps are bound no "
                            "GPU; use --rollout-engine standin for the stand-in engine on GPUs")
    if bool(r.sglang_router_ip) != bool(r.sglang_router_port):
        problems.append("rollout.sglang_router_ip/port: give both (an external router) or neither")
    try:
        EngineLaunch(model_path="m", host="h", port=1, sglang_args=passthrough(r.sglang_args, "sglang"),
                     device="cuda" if r.engine == "standin" else None).flags()
        router_command(RouterLaunch(host="h", port=1, prometheus_port=2, router_args=passthrough(r.router_args,
                                                                                                "router")))
    except LaunchError as err:
        problems.append(f"rollout: {err}")
    if not problems:
        problems += _engine_group_problems(spec)
    if r.colocate and r.spare_nodes:
        problems.append("rollout.spare_nodes: colocated engines run on the trainer's nodes, which have no spares; "
                        "drop --rollout-spare-nodes or --colocate")
    if r.colocate and not problems:
        trainer_gpus = t.actor_num_nodes * t.actor_num_gpus_per_node
        if r.engine in GPU_ENGINES and r.rollout_num_gpus != trainer_gpus:
            problems.append(f"rollout.colocate: rollout_num_gpus {r.rollout_num_gpus} != actor_num_nodes x "
                            f"actor_num_gpus_per_node = {trainer_gpus}; colocated engines share the trainer's "
                            f"GPUs: give --rollout-num-gpus {trainer_gpus}")
        else:
            problems += colocation_problems(spec)
    if not problems:
        problems += _nccl_problems(spec) + _tensor_problems(spec)
    return problems


def _train_async_problems(spec: JobSpec) -> list[str]:
    """slime's train_async.py refuses --colocate (with or without engines: --debug-train-only's too)."""
    if spec.rollout.colocate and "--train-async" in spec.trainer.train_args:
        return ["rollout.colocate: slime's train_async.py (--train-async) generates while the trainer trains, so the "
                "engines need GPUs of their own (and it refuses --colocate): drop --colocate, or submit train.py"]
    return []


def _standin_problems(spec: JobSpec) -> list[str]:
    """The stand-in engine on GPUs (engine: standin): one GPU each; engines beyond one per GPU share
    the GPUs evenly, as steps of their own (a node agent gives each engine GPUs of its own)."""
    r = spec.rollout
    if r.rollout_num_gpus_per_engine != 1:
        return [f"rollout.rollout_num_gpus_per_engine: {r.rollout_num_gpus_per_engine}, but the standin engine runs "
                "on one GPU; give --rollout-num-gpus-per-engine 1 (or use --rollout-engine sglang)"]
    n, gpus = r.num_engines, r.rollout_num_gpus
    if n is not None and (n < gpus or n % gpus):
        return [f"rollout.num_engines: {n} standin engines on {gpus} GPUs; give a multiple of {gpus} (every GPU the "
                "same number of engines), or leave it unset for one engine per GPU"]
    if r.engines_share_gpus and spec.steps.engine_launch != "step":
        return [f"steps.engine_launch: {spec.steps.engine_launch}, but standin engines that share GPUs run as steps "
                "of their own; give engine_launch: step"]
    return []


def _nccl_problems(spec: JobSpec) -> list[str]:
    """--update-weight-transport nccl puts the trainer and every engine rank in one NCCL group, and
    NCCL refuses two ranks on one GPU: colocated, the trainer's rank 0 shares engine 0's GPU;
    stand-in engines may share theirs."""
    r = spec.rollout
    if flag_value(spec.trainer.train_args, "--update-weight-transport") != "nccl" or r.engine not in GPU_ENGINES:
        return []
    if r.colocate:
        who = "the colocated trainer and engines share their GPUs"
    elif r.engines_share_gpus:
        who = f"{r.engine_count} engines share {r.rollout_num_gpus} GPUs"
    else:
        return []
    return [f"trainer.train_args: --update-weight-transport nccl: NCCL refuses two ranks on one GPU, and {who}; "
            "give --update-weight-transport disk"]


def _tensor_problems(spec: JobSpec) -> list[str]:
    """--update-weight-transport tensor hands trainer rank 0's memory to the engines by reference (a
    CUDA IPC handle, a shared-memory file): they must map it, so they share its GPU (colocated, one
    GPU), or on the CPU its node."""
    r, t = spec.rollout, spec.trainer
    if flag_value(t.train_args, "--update-weight-transport") != "tensor":
        return []
    fix = "give --update-weight-transport disk (or nccl, for engines on GPUs of their own)"
    if not r.colocate:
        return [f"trainer.train_args: --update-weight-transport tensor hands the trainer's memory to engines on its "
                f"own GPU, but the engines are not colocated (--colocate); {fix}"]
    if r.engine in GPU_ENGINES and t.actor_num_nodes * t.actor_num_gpus_per_node != 1:
        return [f"trainer.train_args: --update-weight-transport tensor: trainer rank 0 sends every weight, and an "
                f"engine can map only its own GPU's memory; with {t.actor_num_nodes * t.actor_num_gpus_per_node} "
                f"trainer GPUs the engines of the others cannot; {fix}"]
    if t.actor_num_nodes != 1:
        return [f"trainer.train_args: --update-weight-transport tensor: shared memory stays on trainer rank 0's node, "
                f"and the colocated engines span {t.actor_num_nodes} nodes; {fix}"]
    return []


# --colocate: the engines' static pool (weights + KV cache) at most this fraction of each GPU: the
# trainer keeps its CUDA context and communication buffers there while offloaded, and the engines
# need room beyond their pool for activations.
COLOCATE_MAX_MEM_FRACTION = 0.9
# ... and at most this one when the trainer's weights, grads and optimizer state stay on the GPUs
COLOCATE_RESIDENT_MAX_MEM_FRACTION = 0.5


def colocation_problems(spec: JobSpec) -> list[str]:
    """Colocated engines and trainer must both fit on the trainer's GPUs."""
    r, t = spec.rollout, spec.trainer
    if r.engine == "cpu":
        return []
    problems = []
    if r.rollout_num_gpus_per_node != t.actor_num_gpus_per_node:
        problems.append(f"rollout.rollout_num_gpus_per_node: {r.rollout_num_gpus_per_node} != actor_num_gpus_per_node "
                        f"{t.actor_num_gpus_per_node}; colocated engines use the trainer's GPUs of each node: give "
                        f"--rollout-num-gpus-per-node {t.actor_num_gpus_per_node}")
    if r.rollout_num_gpus_per_engine > t.actor_num_gpus_per_node:
        problems.append(f"rollout.rollout_num_gpus_per_engine: {r.rollout_num_gpus_per_engine} GPUs per engine, but "
                        f"the trainer holds {t.actor_num_gpus_per_node} per node; colocated engines stay within a "
                        f"node: give --rollout-num-gpus-per-engine {t.actor_num_gpus_per_node} or less")
    raw = flag_value(r.sglang_args, "--sglang-mem-fraction-static")
    limit = COLOCATE_MAX_MEM_FRACTION if r.offloads_train else COLOCATE_RESIDENT_MAX_MEM_FRACTION
    try:
        fraction = float(raw) if raw is not None else None
    except ValueError:
        fraction = None  # SGLang's own parser reports it
    if fraction is None and not r.offloads_train:
        problems.append(f"rollout.sglang_args: --colocate without --offload-train keeps the trainer's state on the "
                        f"GPUs while the engines generate; give --sglang-mem-fraction-static {limit} or less")
    elif fraction is not None and fraction > limit:
        why = ("the trainer keeps its CUDA context and buffers there while offloaded" if r.offloads_train
               else "without --offload-train the trainer's state stays on the GPUs")
        problems.append(f"rollout.sglang_args: --sglang-mem-fraction-static {raw} leaves no room for the colocated "
                        f"trainer ({why}); give {limit} or less")
    return problems


def _cpu_topology_problems(r: RolloutSpec) -> list[str]:
    """The cpu engine spans nodes as SGLang's would (rollout_num_gpus_per_engine over
    rollout_num_gpus_per_node, whole nodes), one engine per node then."""
    per_engine, per_node = r.rollout_num_gpus_per_engine, r.rollout_num_gpus_per_node
    if per_engine <= per_node:
        return []
    if per_node < 1 or per_engine % per_node:
        return [f"rollout.rollout_num_gpus_per_engine: {per_engine} does not span whole nodes of {per_node} GPUs "
                f"(rollout_num_gpus_per_node); give a multiple of {max(1, per_node)}"]
    if r.engines_per_node not in (None, 1):
        return [f"rollout.engines_per_node: {r.engines_per_node}, but each engine spans {r.nodes_per_engine} whole "
                "nodes; drop --rollout-engines-per-node"]
    return []


def _engine_group_problems(spec: JobSpec) -> list[str]:
    """--prefill-num-servers / --sglang-config, resolved on a copy (finalize does it for real)."""
    from rollout.launch import EngineLaunch, LaunchError

    probe = dataclasses.replace(spec, rollout=dataclasses.replace(spec.rollout))
    problems = engine_groups.resolve(probe)
    if problems:
        return problems
    try:
        found = engine_groups.groups(probe)
    except ValueError as err:
        return [str(err)]
    if probe.rollout.engine == "standin" and any(g.role != "regular" for g in found):
        return ["rollout: the standin engine's prefill/decode disaggregation runs on CPU only; drop "
                "--prefill-num-servers (or the config's prefill/decode groups), or use --rollout-engine cpu"]
    for group in found:
        try:
            EngineLaunch("m", "h", 1, sglang_args=list(group.flags)).flags()
        except LaunchError as err:
            return [f"rollout.sglang_config: the {group.role} group's overrides: "
                    f"{str(err).replace('--sglang-', '--')}"]
    return []


def _engine_flag_problems(spec: JobSpec, notes: list[str]) -> list[str]:
    """The engine command line the supervisor builds, parsed by SGLang's own ServerArgs parser
    (jobs/sglang_args.py): a passthrough SGLang rejects is refused with SGLang's reason."""
    from jobs.sglang_args import ParserUnavailable, parse_errors
    from supervisor.launcher import engine_command
    from supervisor.layout import EnginePlace
    from supervisor.node_rank import node_argv

    r = spec.rollout
    spec = dataclasses.replace(spec, rollout=dataclasses.replace(r))
    engine_groups.resolve(spec)  # no problems: _engine_group_problems ran
    found = engine_groups.groups(spec)
    if (not r.sglang_args and all(g.role == "regular" and not g.flags for g in found)) \
            or not spec.trainer.hf_checkpoint:
        return []  # only slurmrl's own flags: tests/jobs/test_sglang_args.py parses those
    gpus = r.gpus_per_engine_step
    nodes = tuple(f"node{k}" for k in range(r.nodes_per_engine))
    firsts = [sum(g.count for g in found[:i]) for i in range(len(found))]  # the first engine of each group
    places = [EnginePlace(f"engine-{k}", k, nodes, "127.0.0.1", 30000, spec.rollout_group, gpus, 30001, g.role,
                          30002 if g.role == "prefill" else None) for k, g in zip(firsts, found) if g.count]
    # the flags after `-m MODULE`, and the key supervisor.with_key adds inside the step; every node rank's
    argvs, roles = [], []
    for place in places:
        argv = engine_command(spec, place, "python")[3:] + ["--api-key=KEY"]
        argvs += [node_argv(argv, rank, "127.0.0.1") if rank else argv for rank in range(len(nodes))]
        roles += [place.role] * len(nodes)
    try:
        errors = parse_errors(argvs)
    except ParserUnavailable as err:
        notes.append(f"the engine flags were not checked by SGLang's own parser: {err}")
        return []
    refusals = [f"rollout.sglang_args: SGLang refuses the {'' if role == 'regular' else role + ' '}engine "
                f"command line: {error}; fix or drop that --sglang-* flag"
                for role, error in zip(roles, errors) if error]
    return list(dict.fromkeys(refusals))  # each once: every engine and node rank of a group has the same flags


def _numbers(spec: JobSpec) -> list[str]:
    t, ft = spec.trainer, spec.fault_tolerance
    problems = []
    checks = [("trainer.actor_num_nodes", t.actor_num_nodes, 1), ("trainer.actor_num_gpus_per_node",
              t.actor_num_gpus_per_node, 0), ("trainer.cpus_per_task", t.cpus_per_task, 1),
              ("rollout.spare_nodes", spec.rollout.spare_nodes, 0)]
    for where, value, low in checks:
        if value < low:
            problems.append(f"{where}: must be {low} or more, got {value}")
    problems += bounds.violations(ft, "fault_tolerance")  # each field's bounds are on the field
    if t.actor_num_gpus_per_node == 0 and t.actor_num_cpu_workers < 1:
        problems.append("trainer.actor_num_cpu_workers: with actor_num_gpus_per_node 0 the trainer runs CPU "
                        "workers; give --actor-num-cpu-workers 1 or more")
    if spec.starts_engines and spec.rollout.engine_count and ft.min_engines > spec.rollout.engine_count:
        problems.append(f"fault_tolerance.min_engines: {ft.min_engines} is more than the {spec.rollout.engine_count} "
                        "engines asked for; lower it")
    return problems


def _job_problems(spec: JobSpec) -> list[str]:
    problems = []
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", spec.name or ""):
        problems.append(f"name: {spec.name!r} must be letters, digits, '.', '_' or '-' (it names the SLURM job "
                        "and the job dir)")
    minutes = spec.time_minutes
    if minutes is None:
        problems.append(f"time: {spec.time!r} is not a SLURM time; use MM, HH:MM:SS or D-HH:MM:SS")
    elif minutes < 1:
        problems.append("time: must be at least one minute")
    elif spec.fault_tolerance.preempt_grace >= minutes * 60:
        problems.append(f"fault_tolerance.preempt_grace: {spec.fault_tolerance.preempt_grace} s is not shorter than "
                        f"the time limit ({minutes} min); lower it or raise --time")
    if spec.job_dir:
        job_dir = Path(spec.job_dir).expanduser()
        if job_dir.exists() and (not job_dir.is_dir() or any(job_dir.iterdir())):
            problems.append(f"job_dir: {job_dir} already exists and is not empty; give a new folder "
                            "(a job dir holds one job's state)")
    if spec.python and shutil.which(spec.python) is None:
        problems.append(f"python: {spec.python} is not an executable; give the interpreter of the steps")
    return problems


def _capacity(spec: JobSpec, partitions: dict[str, PartitionInfo] | None) -> list[str]:
    if partitions is None:
        return []
    part = partitions.get(spec.partition or "")
    if part is None:
        names = ", ".join(sorted(p for p in partitions if p))
        return [f"partition: {spec.partition!r} is not a partition of this cluster (sinfo lists: {names})"
                if spec.partition else "partition: this cluster has no default partition; give --partition"]
    problems = []
    for k, group in enumerate(het_groups(spec)):
        what = "trainer" if k == 0 else "rollout"
        if group.nodes > part.nodes:
            problems.append(f"{what} group: {group.nodes} nodes, but partition {part.name} has {part.nodes}; "
                            "ask for fewer nodes")
        if group.gpus_per_node > part.gpus_per_node:
            problems.append(f"{what} group: {group.gpus_per_node} GPUs per node, but the nodes of partition "
                            f"{part.name} have {part.gpus_per_node}; ask for fewer GPUs per node")
        cpus = group.ntasks_per_node * group.cpus_per_task
        if cpus > part.cpus_per_node:
            problems.append(f"{what} group: {group.ntasks_per_node} tasks x {group.cpus_per_task} CPUs = {cpus} CPUs "
                            f"per node, but the nodes of partition {part.name} have {part.cpus_per_node}; lower the "
                            "CPUs per task or the tasks per node")
    return problems


def validate(spec: JobSpec, partitions: dict[str, PartitionInfo] | None | bool = True,
             notes: list[str] | None = None) -> list[str]:
    """Every problem of spec, one line each (empty: fine to submit). partitions: True asks sinfo
    once; None or False skips the capacity checks; a dict is used as is (tests). notes: gets a
    line for each check that could not run here."""
    # --debug-train-only starts no engine: the rollout section asks for nothing, so it is not checked
    shape = _numbers(spec) + _train_async_problems(spec) + (_rollout_problems(spec) if spec.starts_engines else [])
    problems = (_job_problems(spec) + step_options.problems(spec.steps) + shape
                + train_args_problems(spec, [] if notes is None else notes))
    if not shape and spec.starts_engines:  # the engine command line is well formed only then
        problems += _engine_flag_problems(spec, [] if notes is None else notes)
    if not shape and spec.time_minutes is not None:  # the groups' sizes mean something only then
        known = (query_partitions(spec.fault_tolerance.slurm_command_timeout) if partitions is True
                 else partitions or None)
        problems += _capacity(spec, known)
    return problems
