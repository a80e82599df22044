"""The RL loop. Rank 0 drives it (rollout, rewards, publishing, reports); every rank trains.

    for rollout_id from the resume point:
        generate_rollout -> broadcast the samples -> old/ref log-probs -> advantages
        -> optimizer steps over global batches -> publish weights as version v+1
        -> every --eval-interval rollouts, eval on the engines (they now serve v+1)
        -> every --save-interval rollouts (and at the end), save

Eval also runs before the first rollout of a fresh start (unless --skip-eval-before-train); its
numbers go in rollout 0's line as before_train/eval/... An eval that a save-now (which skips the
publish) left undone is owed in the checkpoint: the resumed trainer runs it after its first
publish and adds it to that rollout's line, so a resumed run reports what an uninterrupted one does.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from contract.job_dir import JobDir, Metric, Phase, phase_times
from contract.control_protocol import CallerFenced, superseded
from contract.spec import FaultToleranceSpec
from contract.spec_loading import spec_from_yaml
from rollout.buffer import DataBuffer
from rollout.data import JsonlDataSource
from rollout.eval import Evaluator, pass_at_k
from rollout.generate import generate_rollout
from rollout.engine_client import EngineClient
from rollout.router_client import RouterClient
from trainer import checkpoint, rl_step, rollout_journal, save_now
from trainer.backend import Backend
from trainer.colocation import Colocation, EngineSide
from trainer.config import TrainerConfig
from trainer.config.rollout_args import rollout_args
from trainer.batch import TrainSample
from trainer.metrics import Reporter
from trainer.profiling import TrainProfiler
from trainer.rollout_journal import RolloutJournal
from trainer.save_space import tensor_bytes
from trainer.wandb_log import WandbRun
from trainer.supervisor_link import SupervisorLink

log = logging.getLogger(__name__)


class OffPolicyError(RuntimeError):
    """--true-on-policy-mode: the trainer's log-probs differ from the engine's."""


class Driver:
    """Rank 0's side: data, rollouts, engines, weight publishing and reports."""

    def __init__(self, config: TrainerConfig) -> None:
        from transformers import AutoTokenizer

        self.config = config
        job_dir = JobDir(Path(config.run.job_dir))
        # Supervised, the job's waits are its spec's (JOB_DIR/spec.yaml); else their defaults.
        ft = spec_from_yaml(job_dir.spec).fault_tolerance if config.run.supervised else FaultToleranceSpec()
        self.router_url = config.publish.router_url
        self.router = RouterClient(self.router_url, config.publish.api_key, ft.router_request_timeout) \
            if self.router_url else None
        self.supervisor = SupervisorLink.of(job_dir, ft) if config.run.supervised else None
        ro = config.rollout
        tokenizer = (AutoTokenizer.from_pretrained(config.model.hf_checkpoint)
                     if ro.apply_chat_template or ro.rollout_max_prompt_len is not None else None)
        self.buffer = DataBuffer(JsonlDataSource(
            ro.prompt_data, input_key=ro.input_key, label_key=ro.label_key, metadata_key=ro.metadata_key,
            tokenizer=tokenizer, apply_chat_template=ro.apply_chat_template,
            apply_chat_template_kwargs=ro.apply_chat_template_kwargs, tool_key=ro.tool_key,
            max_prompt_len=ro.rollout_max_prompt_len, shuffle=ro.rollout_shuffle,
            seed=ro.rollout_seed, n_samples_per_prompt=ro.n_samples_per_prompt)) if ro.prompt_data else None
        self.rollout = rollout_args(config, self.router_url or "", ft.router_request_timeout,
                                    (lambda url: self.fence(url, "a request to it failed")) if self.router else None,
                                    self.unresponsive if self.router else None)
        wandb = WandbRun(config.logging, job_dir, steps_per_rollout=config.steps_per_rollout,
                         run_config=config.flat()) if config.logging.use_wandb else None
        self.reporter = Reporter(job_dir, config.logging.tensorboard_dir, wandb)
        # Rollouts since the last checkpoint, for a restart from it (only where there are checkpoints).
        self.journal = RolloutJournal(job_dir.root / rollout_journal.FOLDER, config.flat()) \
            if config.checkpoint.save else None
        self.evaluator = Evaluator(
            self.rollout, config.eval.eval_datasets, self.rollout.for_plugins, tokenizer=tokenizer,
            apply_chat_template=ro.apply_chat_template, apply_chat_template_kwargs=ro.apply_chat_template_kwargs,
            eval_function_path=config.eval.eval_function_path or ro.rollout_function_path,
            log_function_path=config.eval.custom_eval_rollout_log_function_path) \
            if config.eval.eval_interval is not None else None
        self.publisher = None
        if not config.run.debug_train_only:
            from trainer.publish import WeightPublisher

            pub = config.publish
            self.publisher = WeightPublisher(
                pub.update_weight_transport, Path(config.run.job_dir), Path(config.model.hf_checkpoint), pub.api_key,
                bucket_bytes=pub.update_weight_buffer_size, keep_versions=pub.keep_weight_versions,
                timeout_s=pub.update_weight_timeout, on_fence=self.fence)

    def engines(self) -> list[str]:
        if self.config.publish.engine_urls:
            return list(self.config.publish.engine_urls)
        if self.supervisor:
            return self.supervisor.ready_engines()
        return sorted(self.router.workers()) if self.router else []

    def fence(self, url: str, reason: str) -> None:
        """An engine that failed a request or an update stops getting work: the supervisor takes
        it out and brings it back at the current version; without one it leaves the router."""
        log.warning("fencing engine %s: %s", url, reason)
        if self.supervisor:
            self.supervisor.engine_failed(url, reason)
        elif self.router:
            self.router.remove_worker(url)

    def unresponsive(self, url: str, reason: str) -> None:
        """An engine that holds requests past their deadline or answers what does not parse, while
        its probes may pass: the supervisor replaces it; without one it leaves the router."""
        log.warning("engine %s does not answer requests: %s", url, reason)
        if self.supervisor:
            self.supervisor.engine_unresponsive(url, reason)
        elif self.router:
            self.router.remove_worker(url)

    def evaluate(self, rollout_id: int) -> dict[str, float]:
        self.reporter.heartbeat(Phase.ROLLOUT, rollout_id)  # eval is generation, with the rollout's timeout
        assert self.evaluator is not None
        return self.evaluator.run(rollout_id, self.buffer)

    def generate(self, rollout_id: int) -> list[TrainSample]:
        done = self.journal.replay(rollout_id) if self.journal else None
        if done is not None:  # generated before a restart from the same checkpoint: trained on again
            groups, buffer_state = done
            if self.buffer and buffer_state is not None:
                self.buffer.load_state_dict(buffer_state)
            log.info("rollout %d: replayed from the rollout journal (generated before the restart)", rollout_id)
        else:
            groups = generate_rollout(self.rollout, rollout_id, self.buffer)
            if self.journal:
                self.journal.record(rollout_id, groups, self.buffer.state_dict() if self.buffer else None)
        return [TrainSample.from_sample(s, self.config.reward.reward_key) for group in groups for s in group]

    def generate_abandonable(self, rollout_id: int, signal: save_now.SaveNowSignal) -> list[TrainSample] | None:
        """generate(), or None if a save-now request abandoned it: the data buffer is then put
        back as it was, so the resumed run generates this rollout again, identically."""
        before = self.buffer.state_dict() if self.buffer else None
        try:
            with signal.abandonable():
                return self.generate(rollout_id)
        except save_now.SaveNow:
            if self.buffer and before is not None:
                self.buffer.load_state_dict(before)
            return None

    def state(self) -> dict[str, Any]:
        return {"data_buffer": self.buffer.state_dict() if self.buffer else None}

    def restore(self, common: dict[str, Any], next_rollout: int) -> None:
        if self.buffer and common.get("data_buffer"):
            self.buffer.load_state_dict(common["data_buffer"])
        self.reporter.drop_from(next_rollout)


class Loop:
    def __init__(self, config: TrainerConfig, backend: Backend) -> None:
        self.config, self.backend = config, backend
        self.rank0 = backend.rank == 0
        self.driver = Driver(config) if self.rank0 else None
        self.next_rollout, self.weight_version = 0, 0
        self.last_saved: int | None = None
        self.eval_owed: int | None = None  # the rollout whose eval a save-now left undone
        self.eval_before_train: dict[str, float] = {}  # reported in rollout 0's line
        self.save_now = save_now.install()
        self.loss_cfg = rl_step.loss_config(config.loss)
        self.colocation = colocation(config, backend, self.driver)
        self.profiler = TrainProfiler(backend.rank)  # slurmrl profile --train

    # ---------------------------------------------------------------- start
    def start(self, initial_weights: Path | None, load_reference: Callable[[], None] | None) -> None:
        """Resume from --load if it holds a checkpoint, else start from `initial_weights` (None:
        the backend loaded them itself); then load the reference model, if there is one."""
        config, ckpt = self.config, self.config.checkpoint
        resume = checkpoint.find_loadable(Path(ckpt.load), ckpt.ckpt_step) if ckpt.load else None
        if resume is not None:
            common = self.backend.load(resume, weights_only=False)
            self.next_rollout, self.weight_version = common["rollout_id"] + 1, common["weight_version"]
            self.last_saved = common["rollout_id"]
            self.eval_owed = common.get("eval_owed")
            if self.driver:
                self.driver.restore(common, self.next_rollout)
                if self.driver.journal:
                    self.driver.journal.resumed(common.get(rollout_journal.LINEAGE_KEY))
            log.info("resumed from %s: next rollout %d, weight version %d", resume, self.next_rollout, self.weight_version)
        elif initial_weights is not None:
            self.backend.load(initial_weights, weights_only=True)
        if load_reference is not None:
            load_reference()
        self.publish()  # the engines serve exactly the trainer's weights from the first rollout on
        if self.colocation:
            self.colocation.to_engines()
        if self.driver and self.driver.evaluator:
            if resume is None and not config.eval.skip_eval_before_train:
                self.eval_before_train = before_train(self.driver.evaluate(0))
            elif self.eval_owed is not None:
                self.driver.reporter.amend(self.eval_owed, self.driver.evaluate(self.eval_owed))
        self.eval_owed = None

    # ---------------------------------------------------------------- loop
    def run(self) -> None:
        for rollout_id in range(self.next_rollout, self.config.run.num_rollout):
            if self.stop_requested(rollout_id):
                log.info("stopping before rollout %d, as the supervisor asked", rollout_id)
                self.save_before_stop(rollout_id - 1)  # the last finished rollout
                break
            metrics = self.step(rollout_id)
            if metrics is None:
                log.warning("abandoned rollout %d to save at once, as the supervisor asked", rollout_id)
                self.save_before_stop(rollout_id - 1)
                break
            save_now = bool(self.backend.broadcast_object(self.save_now.requested))
            self.publish_and_save(rollout_id, metrics, publish=not save_now)
            if save_now:
                log.warning("saving after rollout %d without publishing it, as the supervisor asked", rollout_id)
                self.save_before_stop(rollout_id)
                break
        self.profiler.close()
        if self.driver:
            self.driver.reporter.close()

    def stop_requested(self, rollout_id: int) -> bool:
        stop, profile = self.save_now.requested, None
        if not stop and self.driver and self.driver.supervisor:
            stop, profile = self.driver.supervisor.poll(rollout_id)
        stop, profile = self.backend.broadcast_object((stop, profile))
        if profile:
            self.profiler.arm(profile)
        return bool(stop)

    def save_before_stop(self, rollout_id: int) -> None:
        if self.config.checkpoint.save and rollout_id >= 0 and self.last_saved != rollout_id:
            if self.colocation:
                self.colocation.to_trainer()
            self.save(rollout_id)

    def step(self, rollout_id: int) -> dict[str, Any] | None:
        """One rollout and its training; None if rank 0 abandoned the rollout (save-now)."""
        began = time.monotonic()
        samples: list[TrainSample] | None = None
        if self.driver:
            self.driver.reporter.heartbeat(Phase.ROLLOUT, rollout_id)
            samples = self.driver.generate_abandonable(rollout_id, self.save_now)
        samples = self.backend.broadcast_object(samples)
        if samples is None:
            return None
        rolled = time.monotonic()
        if self.colocation:
            self.colocation.to_trainer()
        metrics = self.train(samples, rollout_id)
        metrics.update({"reward_mean": sum(s.reward for s in samples) / max(1, len(samples)), "samples": len(samples),
                        Metric.ROLLOUT_SECONDS: rolled - began, Metric.TRAIN_SECONDS: time.monotonic() - rolled})
        metrics["tokens_per_s"] = sum(s.tokens.numel() for s in samples) / max(metrics[Metric.TRAIN_SECONDS], 1e-9)
        if self.config.logging.log_passrate:  # slime's passrate/pass@k over the rollout's groups
            passrate = pass_at_k([s.reward for s in samples], self.config.rollout.n_samples_per_prompt)
            metrics.update({f"passrate/{k}": v for k, v in passrate.items()})
        return metrics

    def train(self, samples: list[TrainSample], rollout_id: int) -> dict[str, Any]:
        config, ids = self.config, list(range(len(samples)))
        began = time.monotonic()
        need_entropy = config.loss.entropy_coef != 0
        old = self.backend.log_probs(samples, ids, "actor", with_entropy=True)
        for i, s in enumerate(samples):
            s.old_log_probs = old[i][0]
        out: dict[str, Any] = {}
        if config.loss.true_on_policy_mode:
            out["logp_mismatch_max"] = self.check_on_policy(samples)
        if config.loss.ref_model_needed:
            ref = self.backend.log_probs(samples, ids, "ref")
            for i, s in enumerate(samples):
                s.ref_log_probs = ref[i][0]
        if config.checkpoint.opd_teacher_load:
            teacher = self.backend.log_probs(samples, ids, "teacher")
            for i, s in enumerate(samples):
                s.teacher_log_probs = teacher[i][0]
            out["teacher_kl"] = _masked_token_mean([s.old_log_probs - s.teacher_log_probs for s in samples], samples)
        if config.loss.advantage_estimator == "ppo":
            values = self.backend.values(samples, ids)
            for i, s in enumerate(samples):
                s.values = values[i]
        rl_step.compute_advantages(config.loss, config.rollout.n_samples_per_prompt, samples)
        out["entropy"] = _masked_token_mean([old[i][1] for i in ids], samples)
        # the forward passes before the first optimizer step: old, ref and teacher log-probs, values
        out[Metric.LOG_PROBS_SECONDS] = time.monotonic() - began
        totals: dict[str, float] = {}
        size = config.batching.global_batch_size
        steps = [ids[i:i + size] for i in range(0, len(ids), size)]
        for step_id, batch in enumerate(steps):
            if self.driver:
                self.driver.reporter.heartbeat(Phase.TRAIN, rollout_id)  # the train timeout is per optimizer step
            with self.profiler.step(f"rollout={rollout_id} step={step_id}"):
                step_metrics = self.backend.train_step(samples, batch,
                                                       rl_step.make_pack_loss(self.loss_cfg, samples, batch),
                                                       need_entropy, rollout_id=rollout_id, step_id=step_id)
            if config.loss.advantage_estimator == "ppo":
                critic_loss = rl_step.make_value_pack_loss(config.loss.value_clip, config.loss.calculate_per_token_loss,
                                                           samples, batch)
                critic_metrics = self.backend.train_step(samples, batch, critic_loss, False, role="critic")
                step_metrics.update(value_loss=critic_metrics["value_loss"], value_clipfrac=critic_metrics["value_clipfrac"],
                                    critic_grad_norm=critic_metrics["grad_norm"])
            self.profiler.after_step()
            for name, value in step_metrics.items():
                totals[name] = totals.get(name, 0.0) + value / len(steps)
        out.update(totals)
        return out

    def check_on_policy(self, samples: list[TrainSample]) -> float:
        worst = logp_mismatch(samples)
        if worst > self.config.loss.true_on_policy_tolerance:
            raise OffPolicyError(f"--true-on-policy-mode: max |logp_train - logp_rollout| = {worst:.3g} exceeds "
                                 f"--true-on-policy-tolerance {self.config.loss.true_on_policy_tolerance:g}: the trainer "
                                 "and the engines no longer compute the same distribution")
        return worst

    # ---------------------------------------------------------------- weights and checkpoints
    def publish(self) -> dict[str, Any]:
        """Send the current weights to every ready engine as version self.weight_version."""
        weights = self.backend.hf_weights()
        if self.driver is None or self.driver.publisher is None:
            for _ in weights:  # collective: the other ranks take part in the gathers
                pass
            return {}
        self.driver.reporter.heartbeat(Phase.PUBLISH, self.next_rollout)
        result = self.driver.publisher.publish(str(self.weight_version), self.driver.engines(), weights)
        if self.driver.supervisor:
            self.driver.supervisor.published(self.weight_version, result.updated, result.fenced)
        return {Metric.PUBLISH_SECONDS: result.seconds, "engines_updated": len(result.updated),
                "engines_fenced": len(result.fenced)}

    def publish_and_save(self, rollout_id: int, metrics: dict[str, Any], publish: bool = True) -> None:
        # weight_version: the version the engines generated this rollout with; published_version:
        # the one trained on it. Not published (save-now): the resumed trainer publishes it first thing.
        metrics["weight_version"] = self.weight_version
        self.weight_version += 1
        self.next_rollout = rollout_id + 1
        last = rollout_id == self.config.run.num_rollout - 1
        ckpt = self.config.checkpoint
        save_due = ckpt.save and (last or (ckpt.save_interval and (rollout_id + 1) % ckpt.save_interval == 0))
        if self.colocation and publish:
            # Colocated, the trainer saves while it holds the GPUs, before it publishes; the eval
            # that follows is owed in that checkpoint, as after a save-now.
            if save_due:
                metrics[Metric.SAVE_SECONDS] = self.timed_save(rollout_id, self.config.eval.due(rollout_id))
                save_due = False
            self.colocation.before_publish()
        metrics.update(self.publish() if publish else {}, published_version=self.weight_version)
        if self.colocation and publish:
            self.colocation.to_engines()
        if self.config.eval.due(rollout_id):
            if not publish:
                self.eval_owed = rollout_id  # the engines are a version behind: the resumed run evaluates
            elif self.driver:
                began = time.monotonic()
                metrics.update(self.driver.evaluate(rollout_id))
                metrics[Metric.EVAL_SECONDS] = time.monotonic() - began
        if rollout_id == 0:
            metrics.update(self.eval_before_train)
        if save_due:
            metrics[Metric.SAVE_SECONDS] = self.timed_save(rollout_id)
        metrics.update(phase_times(metrics))
        if self.driver:
            self.driver.reporter.rollout(rollout_id, metrics)

    def timed_save(self, rollout_id: int, eval_owed: bool = False) -> float:
        began = time.monotonic()
        owed, self.eval_owed = self.eval_owed, rollout_id if eval_owed else self.eval_owed
        self.save(rollout_id)
        self.eval_owed = owed
        return time.monotonic() - began

    def save(self, rollout_id: int) -> None:
        # A trainer of a run SLURM requeued away (its node cut off, then back, SIGTERM saving it)
        # must not write over the newer run's checkpoints.
        job_dir = self.config.run.job_dir
        if self.backend.broadcast_object(bool(job_dir) and superseded(JobDir(Path(job_dir)))):
            raise CallerFenced(f"not saving rollout {rollout_id}: a newer run of the job owns {job_dir}")
        if self.driver:
            self.driver.reporter.heartbeat(Phase.SAVE, rollout_id)
        common = {"rollout_id": rollout_id, "weight_version": self.weight_version, "eval_owed": self.eval_owed,
                  rollout_journal.LINEAGE_KEY: rollout_journal.new_lineage(),
                  **(self.driver.state() if self.driver else {})}
        common = self.backend.broadcast_object(common)
        checkpoint.save(Path(self.config.checkpoint.save), rollout_id, lambda folder: self.backend.save(folder, common),
                        keep=self.config.checkpoint.keep_checkpoints, needs_bytes=tensor_bytes(self.backend))
        self.last_saved = rollout_id
        if self.driver and self.driver.journal:
            self.driver.journal.saved(common[rollout_journal.LINEAGE_KEY])


def colocation(config: TrainerConfig, backend: Backend, driver: Driver | None) -> Colocation | None:
    """The phase order of --offload-train / --offload-rollout (trainer.colocation), or None."""
    if not (config.run.offload_train or config.run.offload_rollout):
        return None
    engines = None
    if driver and config.run.offload_rollout:
        client = EngineClient(config.publish.api_key, config.publish.update_weight_timeout)
        engines = EngineSide(client, driver.engines, driver.fence, driver.supervisor)
    return Colocation(backend, config.run.offload_train, engines)


def before_train(metrics: dict[str, float]) -> dict[str, float]:
    return {f"before_train/{name}": value for name, value in metrics.items()}


def _masked_token_mean(values: list[torch.Tensor], samples: list[TrainSample]) -> float:
    """The mean of per-token values over every counted response token of the rollout."""
    total = sum(float((v * s.loss_mask).sum()) for v, s in zip(values, samples))
    return total / max(1.0, sum(float(s.loss_mask.sum()) for s in samples))


def logp_mismatch(samples: list[TrainSample]) -> float:
    """max |logp_train - logp_rollout| over every counted response token."""
    worst = 0.0
    for s in samples:
        if s.rollout_log_probs is None or s.rollout_log_probs.shape != s.old_log_probs.shape:
            raise OffPolicyError("--true-on-policy-mode needs the engines' log-prob of every response token")
        diff = (s.old_log_probs - s.rollout_log_probs).abs() * s.loss_mask
        worst = max(worst, float(diff.max()) if diff.numel() else 0.0)
    return worst


def seed_everything(seed: int) -> None:
    import random

    import numpy

    random.seed(seed)
    numpy.random.seed(seed)
    torch.manual_seed(seed)
