"""The one place that reads the trainer's flags for the loop: it builds every part of the loop
(trainer.loop) and of --debug-rollout-only (trainer.rollout_only) from them. Every part takes
plain typed values; nothing past this module sees the argparse Namespace.
"""

from __future__ import annotations

import argparse
import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from contract.job_dir import JobDir, Phase
from contract.spec import FaultToleranceSpec
from contract.spec_loading import spec_from_yaml
from rollout.buffer import DataBuffer
from rollout.data import JsonlDataSource
from rollout.engine_client import EngineClient
from rollout.eval import Evaluator
from rollout.generate import RolloutArgs
from rollout.router_client import RouterClient
from trainer import rl_step, rollout_journal, save_now
from trainer.backend import Backend
from trainer.checkpointer import CheckpointConfig, Checkpointer, Stateful
from trainer.colocation import Colocation, EngineSide
from trainer.engine_fleet import EngineFleet
from trainer.evals import EvalSchedule
from trainer.loop import Loop, Progress
from trainer.metrics import Reporter
from trainer.profiling import TrainProfiler
from trainer.publish import WeightPublisher
from trainer.publisher import Publisher
from trainer.rollout_journal import RolloutJournal
from trainer.rollout_only import RolloutOnly
from trainer.rollout_source import RolloutGenerator, SyncRolloutSource
from trainer.save_now import StopRequests
from trainer.supervisor_link import SupervisorLink
from trainer.train_step import TrainStep, TrainStepConfig
from trainer.wandb_log import WandbRun


def rollout_args(args: argparse.Namespace, router_url: str, router_timeout_s: float,
                 on_engine_failure: Callable[[str], None] | None,
                 on_engine_unresponsive: Callable[[str, str], None] | None = None) -> RolloutArgs:
    names = set(RolloutArgs.__dataclass_fields__) - {"router_url", "router_timeout_s", "api_key",
                                                     "engine_failure_handler", "engine_unresponsive_handler",
                                                     "decode_speed", "engine_check_timeout_s", "plugin_args"}
    return RolloutArgs(router_url=router_url, router_timeout_s=router_timeout_s, api_key=args.api_key,
                       engine_failure_handler=on_engine_failure, engine_unresponsive_handler=on_engine_unresponsive,
                       plugin_args=args,
                       **{name: getattr(args, name) for name in names})


@dataclass
class Rank0Parts:
    """What rank 0 alone holds: the engines, the reports, generation, evals and the weight transport."""
    fleet: EngineFleet
    reporter: Reporter
    generator: RolloutGenerator
    journal: RolloutJournal | None  # rollouts since the last checkpoint (only where there are checkpoints)
    evals: EvalSchedule
    transport: WeightPublisher | None  # None with --debug-train-only


def build_rank0(args: argparse.Namespace) -> Rank0Parts:
    from transformers import AutoTokenizer

    job_dir = JobDir(Path(args.job_dir))
    # Supervised, the job's waits are its spec's (JOB_DIR/spec.yaml); else their defaults.
    ft = spec_from_yaml(job_dir.spec).fault_tolerance if args.supervised else FaultToleranceSpec()
    router_url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}" if args.sglang_router_ip else None
    router = RouterClient(router_url, args.api_key, ft.router_request_timeout) if router_url else None
    fleet = EngineFleet(args.engine_urls, SupervisorLink.of(job_dir, ft) if args.supervised else None, router)
    tokenizer = (AutoTokenizer.from_pretrained(args.hf_checkpoint)
                 if args.apply_chat_template or args.rollout_max_prompt_len is not None else None)
    buffer = DataBuffer(JsonlDataSource(
        args.prompt_data, input_key=args.input_key, label_key=args.label_key, metadata_key=args.metadata_key,
        tokenizer=tokenizer, apply_chat_template=args.apply_chat_template,
        apply_chat_template_kwargs=args.apply_chat_template_kwargs, tool_key=args.tool_key,
        max_prompt_len=args.rollout_max_prompt_len, shuffle=args.rollout_shuffle,
        seed=args.rollout_seed, n_samples_per_prompt=args.n_samples_per_prompt)) if args.prompt_data else None
    rollout = rollout_args(args, router_url or "", ft.router_request_timeout,
                           (lambda url: fleet.fence(url, "a request to it failed")) if router else None,
                           fleet.unresponsive if router else None)
    reporter = Reporter(job_dir, args.tensorboard_dir, WandbRun(args, job_dir) if args.use_wandb else None)
    journal = (RolloutJournal(job_dir.root / rollout_journal.FOLDER, rollout_journal.fingerprint(vars(args)))
               if args.save else None)
    evaluator = Evaluator(
        rollout, args.eval_datasets, args, tokenizer=tokenizer, apply_chat_template=args.apply_chat_template,
        apply_chat_template_kwargs=args.apply_chat_template_kwargs,
        eval_function_path=args.eval_function_path or args.rollout_function_path,
        log_function_path=args.custom_eval_rollout_log_function_path) if args.eval_interval is not None else None
    transport = None if args.debug_train_only else WeightPublisher(
        args.update_weight_transport, Path(args.job_dir), Path(args.hf_checkpoint), args.api_key,
        bucket_bytes=args.update_weight_buffer_size, keep_versions=args.keep_weight_versions,
        timeout_s=args.update_weight_timeout, on_fence=fleet.fence)
    return Rank0Parts(
        fleet=fleet, reporter=reporter,
        generator=RolloutGenerator(rollout, buffer, journal, args.reward_key, save_now.install()), journal=journal,
        evals=EvalSchedule(args.eval_interval, args.skip_eval_before_train, evaluator, buffer, reporter.heartbeat,
                           reporter.amend),
        transport=transport)


def build_loop(args: argparse.Namespace, backend: Backend) -> Loop:
    rank0 = build_rank0(args) if backend.rank == 0 else None
    heartbeat = rank0.reporter.heartbeat if rank0 else _no_heartbeat
    evals = rank0.evals if rank0 else EvalSchedule(args.eval_interval, args.skip_eval_before_train, None, None,
                                                   heartbeat, _no_amend)
    progress = Progress()
    source = SyncRolloutSource(rank0.generator if rank0 else None, backend.broadcast_object, heartbeat)
    parts: list[Stateful] = [progress, evals, source]
    if rank0 and rank0.journal:
        parts.append(rank0.journal)
    checkpointer = Checkpointer(backend, CheckpointConfig(
        save_dir=Path(args.save) if args.save else None, load_dir=Path(args.load) if args.load else None,
        load_step=args.ckpt_step, save_interval=args.save_interval, keep=args.keep_checkpoints,
        num_rollout=args.num_rollout, job_dir=Path(args.job_dir) if args.job_dir else None),
        parts, [rank0.journal.checkpointed] if rank0 and rank0.journal else [], heartbeat)
    profiler = TrainProfiler(backend.rank)  # slurmrl profile --train
    train_step = TrainStep(backend, TrainStepConfig(
        global_batch_size=args.global_batch_size, need_entropy=args.entropy_coef != 0,
        on_policy_tolerance=args.true_on_policy_tolerance if args.true_on_policy_mode else None,
        ref_model=bool(args.ref_model_needed), teacher=bool(args.opd_teacher_load),
        critic=args.advantage_estimator == "ppo", value_clip=args.value_clip,
        per_token_loss=args.calculate_per_token_loss),
        rl_step.loss_config(args), functools.partial(rl_step.compute_advantages, args), profiler, heartbeat)
    supervisor = rank0.fleet.supervisor if rank0 else None
    publisher = Publisher(rank0.transport if rank0 else None, rank0.fleet.engines if rank0 else _no_engines,
                          supervisor, heartbeat)
    stops = StopRequests(save_now.install(), supervisor.poll if supervisor else None, backend.broadcast_object,
                         profiler.arm)
    return Loop(backend, progress, source, train_step, publisher, checkpointer, evals, stops,
                colocation(args, backend, rank0.fleet if rank0 else None), rank0.reporter if rank0 else None,
                profiler, args.num_rollout, args.n_samples_per_prompt if args.log_passrate else None)


def colocation(args: argparse.Namespace, backend: Backend, fleet: EngineFleet | None) -> Colocation | None:
    """The phase order of --offload-train / --offload-rollout (trainer.colocation), or None."""
    if not (args.offload_train or args.offload_rollout):
        return None
    engines = None
    if fleet and args.offload_rollout:
        engines = EngineSide(EngineClient(args.api_key, args.update_weight_timeout), fleet.engines, fleet.fence,
                             fleet.supervisor)
    return Colocation(backend, args.offload_train, engines)


def build_rollout_only(args: argparse.Namespace) -> RolloutOnly | None:
    """--debug-rollout-only's run on rank 0; None on the other ranks (they have nothing to do)."""
    if int(os.environ.get("RANK", "0")) != 0:
        return None
    return RolloutOnly(build_rank0(args), save_now.install(), args.num_rollout, Path(args.hf_checkpoint))


def _no_heartbeat(phase: Phase, rollout_id: int) -> None:
    """Ranks other than 0 write no heartbeat."""


def _no_engines() -> list[str]:
    """Ranks other than 0 send no weights."""
    return []


def _no_amend(rollout_id: int, metrics: dict[str, Any]) -> None:
    """Ranks other than 0 write no reports."""
