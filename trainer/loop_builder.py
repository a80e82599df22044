"""The one place that reads the trainer's configuration for the loop: it builds every part of the
loop (trainer.loop) and of --debug-rollout-only (trainer.rollout_only) from TrainerConfig's
sections. Every part takes plain typed values; only this module (and trainer.config's own
rollout_args) reads the whole config.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

from contract.job_dir import JobDir, Phase
from contract.spec import FaultToleranceSpec
from contract.spec_loading import spec_from_yaml
from rollout.buffer import DataBuffer
from rollout.data import JsonlDataSource
from rollout.engine_client import EngineClient
from rollout.eval import Evaluator
from rollout.fully_async import FullyAsyncWorker
from rollout.group_ledger import GroupLedger
from rollout.plugins import load_function
from rollout.router_client import RouterClient
from trainer import rl_step, rollout_journal, save_now
from trainer.ahead_source import AheadRolloutSource
from trainer.backend import Backend
from trainer.checkpointer import CheckpointConfig, Checkpointer, Stateful
from trainer.colocation import Colocation, EngineSide
from trainer.config import TrainerConfig, read_hf_config
from trainer.config.rollout_args import rollout_args
from trainer.engine_fleet import EngineFleet
from trainer.evals import EvalSchedule
from trainer.flops import fwd_flops
from trainer.fully_async_source import ENGINE_CALL_TIMEOUT_S, FullyAsyncOptions, FullyAsyncSource
from trainer.loop import Loop, Progress
from trainer.memory_history import MemoryHistory
from trainer.metrics import Reporter
from trainer.old_actor import OldActor
from trainer.phase_memory import PhaseMemory
from trainer.profiling import TrainProfiler
from trainer.publish import WeightPublisher
from trainer.publisher import Publisher
from trainer.rank0_parts import Rank0Parts
from trainer.rollout_journal import RolloutJournal
from trainer.rollout_only import RolloutOnly
from trainer.rollout_source import Heartbeat, RolloutGenerator, RolloutSource, SyncRolloutSource
from trainer.save_now import StopRequests
from trainer.slime_loss import SlimeLossPlugins
from trainer.supervisor_link import SupervisorLink
from trainer.train_data import CONVERT, POST_PROCESS, TrainData
from trainer.train_step import TrainPlugins, TrainStep, TrainStepConfig
from trainer.wandb_log import WandbRun


def build_rank0(config: TrainerConfig) -> Rank0Parts:
    from transformers import AutoTokenizer

    run, ro, ev, pub = config.run, config.rollout, config.eval, config.publish
    job_dir = JobDir(Path(run.job_dir))
    # Supervised, the job's waits are its spec's (JOB_DIR/spec.yaml); else their defaults.
    ft = spec_from_yaml(job_dir.spec).fault_tolerance if run.supervised else FaultToleranceSpec()
    router_url = pub.router_url
    router = RouterClient(router_url, pub.api_key, ft.router_request_timeout) if router_url else None
    fleet = EngineFleet(pub.engine_urls, SupervisorLink.of(job_dir, ft) if run.supervised else None, router)
    tokenizer = (AutoTokenizer.from_pretrained(config.model.model_files)
                 if ro.apply_chat_template or ro.rollout_max_prompt_len is not None
                 or any(s.apply_chat_template for s in ev.eval_datasets) else None)
    plugin_args = config.plugin_namespace()
    buffer = DataBuffer(JsonlDataSource(
        ro.prompt_data, input_key=ro.input_key, label_key=ro.label_key, metadata_key=ro.metadata_key,
        tokenizer=tokenizer, apply_chat_template=ro.apply_chat_template,
        apply_chat_template_kwargs=ro.apply_chat_template_kwargs, tool_key=ro.tool_key,
        max_prompt_len=ro.rollout_max_prompt_len, shuffle=ro.rollout_shuffle,
        seed=ro.rollout_seed, n_samples_per_prompt=ro.n_samples_per_prompt),
        _plugin(ro.buffer_filter_path, "--buffer-filter-path"), plugin_args,
        ro.buffer_filter_path or "") if ro.prompt_data else None
    rollout = rollout_args(config, router_url or "", ft.router_request_timeout,
                           (lambda url: fleet.drop(url, "a request to it failed")) if router else None,
                           fleet.unresponsive if router else None,
                           fleet.supervisor.plugin_error if fleet.supervisor else None)
    wandb = WandbRun(config.logging, job_dir, steps_per_rollout=config.steps_per_rollout,
                     run_config=config.flat()) if config.logging.use_wandb else None
    reporter = Reporter(job_dir, config.logging.tensorboard_dir, wandb)
    journal = (RolloutJournal(job_dir.rollout_journal, rollout_journal.fingerprint(config.flat()))
               if config.checkpoint.save else None)
    evaluator = Evaluator(
        rollout, ev.eval_datasets, rollout.for_plugins, tokenizer=tokenizer,
        eval_function_path=ev.eval_function_path or ro.rollout_plugin,
        log_function_path=ev.custom_eval_rollout_log_function_path) if ev.eval_interval is not None else None
    transport = None if run.debug_train_only else WeightPublisher(
        pub.update_weight_transport, Path(run.job_dir), Path(config.model.model_files), pub.api_key,
        bucket_bytes=pub.update_weight_buffer_size, keep_versions=pub.keep_weight_versions,
        timeout_s=pub.update_weight_timeout, on_drop=fleet.drop,
        serving=fleet.supervisor.serving_engines if fleet.supervisor else None, launches=fleet.launches)
    return Rank0Parts(
        fleet=fleet, reporter=reporter,
        generator=RolloutGenerator(rollout, buffer, journal, train_data(config, plugin_args), save_now.install()),
        journal=journal,
        evals=EvalSchedule(ev.eval_interval, ev.skip_eval_before_train, evaluator, buffer, reporter.heartbeat,
                           reporter.amend),
        transport=transport)


def build_loop(config: TrainerConfig, backend: Backend) -> Loop:
    rank0 = build_rank0(config) if backend.rank == 0 else None
    heartbeat = rank0.reporter.heartbeat if rank0 else _no_heartbeat
    ev = config.eval
    evals = rank0.evals if rank0 else EvalSchedule(ev.eval_interval, ev.skip_eval_before_train, None, None,
                                                   heartbeat, _no_amend)
    progress = Progress()
    source = rollout_source(config, rank0, backend, heartbeat)
    parts: list[Stateful] = [progress, evals, source]
    if rank0 and rank0.journal:
        parts.append(rank0.journal)
    ckpt, run, loss = config.checkpoint, config.run, config.loss
    checkpointer = Checkpointer(backend, CheckpointConfig(
        save_dir=Path(ckpt.save) if ckpt.save else None, load_dir=Path(ckpt.load) if ckpt.load else None,
        load_step=ckpt.ckpt_step, save_interval=ckpt.save_interval, keep=ckpt.keep_checkpoints,
        num_rollout=run.num_rollout, job_dir=Path(run.job_dir) if run.job_dir else None, save_hf=ckpt.save_hf,
        model_files=Path(config.model.model_files)),
        parts, [rank0.journal.checkpointed] if rank0 and rank0.journal else [], heartbeat)
    memory_history = (MemoryHistory(backend.rank, run.memory_snapshot_dir, run.memory_snapshot_path,
                                    run.memory_snapshot_num_steps) if run.record_memory_history else None)
    profiler = TrainProfiler(backend.rank, memory_history)  # slurmrl profile --train, --record-memory-history
    asynchronous = config.asynchronous
    # The staleness a sample can reach: the versions whose weights --keep-old-actor keeps.
    reach = (asynchronous.max_weight_staleness or 0) if config.rollout.fully_async else \
        asynchronous.update_weights_interval
    old_actor = OldActor(backend, reach) if asynchronous.keep_old_actor else None
    memory = PhaseMemory.of_this_process() if rank0 else PhaseMemory(None)  # rank 0 reports
    train_step = TrainStep(backend, TrainStepConfig(
        global_batch_size=config.batching.global_batch_size, need_entropy=loss.entropy_coef != 0,
        on_policy_tolerance=loss.true_on_policy_tolerance if loss.true_on_policy_mode else None,
        ref_model=loss.ref_model_needed, teacher=bool(ckpt.opd_teacher_load),
        critic=loss.advantage_estimator == "ppo", value_clip=loss.value_clip,
        per_token_loss=loss.calculate_per_token_loss, kl_coef=loss.kl_coef,
        fwd_flops=functools.partial(fwd_flops, read_hf_config(config.model.model_files))),
        rl_step.loss_config(loss),
        functools.partial(rl_step.compute_advantages, loss), profiler, heartbeat, memory, train_plugins(config),
        old_actor)
    supervisor = rank0.fleet.supervisor if rank0 else None
    publisher = Publisher(rank0.transport if rank0 else None, rank0.fleet.engines if rank0 else _no_engines,
                          supervisor, heartbeat)
    stops = StopRequests(save_now.install(), supervisor.poll if supervisor else None, backend.broadcast_object,
                         profiler.arm)
    return Loop(backend, progress, source, train_step, publisher, checkpointer, evals, stops,
                colocation(config, backend, rank0.fleet if rank0 else None), rank0.reporter if rank0 else None,
                profiler, memory, run.num_rollout, config.logging.log_passrate, asynchronous.update_weights_interval,
                old_actor)


def rollout_source(config: TrainerConfig, rank0: Rank0Parts | None, backend: Backend,
                   heartbeat: Heartbeat) -> RolloutSource:
    """slime's train.py order, train_async.py's (--train-async: generation one rollout ahead of
    training), or its fully asynchronous rollout (groups generating across rollouts)."""
    run, ro, asynchronous = config.run, config.rollout, config.asynchronous
    generator = rank0.generator if rank0 else None
    if ro.fully_async:
        worker, client, engines = None, None, _no_engines
        if rank0 and generator and generator.buffer:
            capacity = int(asynchronous.async_data_buffer_capacity_factor * ro.rollout_batch_size)
            worker = FullyAsyncWorker(generator.rollout_args, GroupLedger(generator.buffer, capacity))
            client, engines = EngineClient(config.publish.api_key, ENGINE_CALL_TIMEOUT_S), rank0.fleet.engines
        options = FullyAsyncOptions(ro.rollout_batch_size, asynchronous.max_weight_staleness,
                                    asynchronous.async_unused_samples_handler, asynchronous.pause_generation_mode,
                                    generator.train_data if generator else TrainData(None))
        return FullyAsyncSource(worker, rank0.journal if rank0 else None, engines, client, options,
                                backend.broadcast_object, heartbeat, save_now.install())
    if asynchronous.train_async:
        return AheadRolloutSource(generator, backend.broadcast_object, heartbeat, save_now.install(), run.num_rollout)
    return SyncRolloutSource(generator, backend.broadcast_object, heartbeat)


def _plugin(path: str | None, flag: str) -> Any:
    """A slime plug-in by its dotted path (typed by its contract where it is called), or None."""
    return load_function(path, flag) if path else None


def train_data(config: TrainerConfig, plugin_args: Any) -> TrainData:
    """How a rollout's samples become the trainer's, with slime's conversion plug-ins."""
    rm = config.reward
    post_process, convert = rm.custom_reward_post_process_path, rm.custom_convert_samples_to_train_data_path
    return TrainData(rm.reward_key, plugin_args, _plugin(post_process, POST_PROCESS), post_process or "",
                     _plugin(convert, CONVERT), convert or "")


def train_plugins(config: TrainerConfig) -> TrainPlugins:
    """slime's trainer plug-ins, on every rank (each rank runs the train step on the whole rollout)."""
    loss = config.loss
    args = config.plugin_namespace()
    slime_loss = None
    if loss.custom_loss_function_path or loss.custom_tis_function_path or loss.custom_pg_loss_reducer_function_path \
            or loss.get_mismatch_metrics:
        slime_loss = SlimeLossPlugins(
            args, _plugin(loss.custom_loss_function_path, "--custom-loss-function-path"),
            _plugin(loss.custom_tis_function_path, "--custom-tis-function-path"),
            _plugin(loss.custom_pg_loss_reducer_function_path, "--custom-pg-loss-reducer-function-path"),
            loss.get_mismatch_metrics)
    return TrainPlugins(args, loss.compute_advantages_and_returns,
                        _plugin(loss.custom_advantage_function_path, "--custom-advantage-function-path"),
                        _plugin(loss.rollout_data_postprocess_path, "--rollout-data-postprocess-path"), slime_loss)


def colocation(config: TrainerConfig, backend: Backend, fleet: EngineFleet | None) -> Colocation | None:
    """The phase order of --offload-train / --offload-rollout (trainer.colocation), or None."""
    run, pub = config.run, config.publish
    if not (run.offload_train or run.offload_rollout):
        return None
    engines = None
    if fleet and run.offload_rollout:
        engines = EngineSide(EngineClient(pub.api_key, pub.update_weight_timeout), fleet.engines, fleet.drop,
                             fleet.supervisor)
    return Colocation(backend, run.offload_train, engines)


def build_rollout_only(config: TrainerConfig) -> RolloutOnly | None:
    """--debug-rollout-only's run on rank 0; None on the other ranks (they have nothing to do)."""
    if int(os.environ.get("RANK", "0")) != 0:
        return None
    return RolloutOnly(build_rank0(config), save_now.install(), config.run.num_rollout,
                       Path(config.model.hf_checkpoint))


def _no_heartbeat(phase: Phase, rollout_id: int) -> None:
    """Ranks other than 0 write no heartbeat."""


def _no_engines() -> list[str]:
    """Ranks other than 0 send no weights."""
    return []


def _no_amend(rollout_id: int, metrics: dict[str, Any]) -> None:
    """Ranks other than 0 write no reports."""
