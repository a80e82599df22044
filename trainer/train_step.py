"""The train step: one rollout's samples -> old (and ref, teacher) log-probs, values, advantages
-> optimizer steps over global batches. Collective: every rank runs it on the same samples."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch

from contract.job_dir import Metric, Phase
from rollout.plugin_contracts import CustomAdvantage, RolloutDataPostprocess
from trainer import advantages as adv
from trainer import rl_step
from trainer.backend import Backend
from trainer.batch import TrainSample
from trainer.losses import LossConfig
from trainer.old_actor import OldActor
from trainer.phase_memory import PhaseMemory
from trainer.profiling import TrainProfiler
from trainer.rollout_batch import rollout_batch, write_back
from trainer.rollout_source import Heartbeat
from trainer.slime_loss import SlimeLossPlugins, make_slime_pack_loss


class OffPolicyError(RuntimeError):
    """--true-on-policy-mode: the trainer's log-probs differ from the engine's."""


@dataclass(frozen=True)
class TrainStepConfig:
    global_batch_size: int  # samples per optimizer step
    need_entropy: bool  # the loss has an entropy term (--entropy-coef)
    on_policy_tolerance: float | None  # --true-on-policy-mode: the largest |logp_train - logp_rollout|
    ref_model: bool  # ref log-probs are needed (KL)
    teacher: bool  # on-policy distillation: the teacher's log-probs
    critic: bool  # PPO: values, and a critic step after each actor step
    value_clip: float
    per_token_loss: bool
    kl_coef: float = 0.0  # --kl-coef: a custom advantage function gets the KL to the reference
    fwd_flops: Callable[[list[int]], float] | None = None  # the model's forward FLOPs for sequence lengths


@dataclass(frozen=True)
class TrainPlugins:
    """slime's trainer plug-ins (rollout.plugin_contracts), each None when not given."""
    args: Any = None  # slime's Namespace, what they get
    compute_advantages: bool = True  # False: --disable-compute-advantages-and-returns (SFT)
    custom_advantage: CustomAdvantage | None = None
    data_postprocess: RolloutDataPostprocess | None = None
    loss: SlimeLossPlugins | None = None  # slime's loss plug-ins: trainer.slime_loss's loss in place of rl_step's


class TrainStep:
    def __init__(self, backend: Backend, config: TrainStepConfig, loss: LossConfig,
                 advantages: Callable[[list[TrainSample]], None], profiler: TrainProfiler,
                 heartbeat: Heartbeat, memory: PhaseMemory, plugins: TrainPlugins = TrainPlugins(),
                 old_actor: OldActor | None = None) -> None:
        """advantages: fills each sample's advantages (and returns) in place. memory: the loop's
        per-phase peak GPU memory (log_probs and train are measured here). old_actor
        (--keep-old-actor): the old log-probs are the generating weights'."""
        self.backend = backend
        self.config = config
        self.loss = loss
        self.advantages = advantages
        self.profiler = profiler
        self.heartbeat = heartbeat
        self.memory = memory
        self.plugins = plugins
        self.old_actor = old_actor

    def run(self, rollout_id: int, samples: list[TrainSample], version: int = 0) -> dict[str, Any]:
        """version: the trainer's weight version (what --keep-old-actor's live weights are)."""
        began = time.monotonic()
        with self.memory.phase("log_probs"):
            out = self.prepare(samples, rollout_id, version) if self.plugins.compute_advantages else {}
        # the forward passes before the first optimizer step: old, ref and teacher log-probs, values
        out[Metric.LOG_PROBS_SECONDS] = time.monotonic() - began
        stepping = time.monotonic()
        with self.memory.phase("train"):
            out.update(self.optimize(rollout_id, samples))
        train_s = max(time.monotonic() - stepping, 1e-9)
        seq_lens = [s.tokens.numel() for s in samples]  # prompts and responses, as slime counts seq_lens
        out[Metric.TRAIN_TOKENS_PER_S] = sum(seq_lens) / train_s
        if self.config.fwd_flops is not None:  # per GPU, as slime divides by the world size
            tflops = self.config.fwd_flops(seq_lens) / self.backend.world_size / 1e12
            out[Metric.TRAIN_TFLOPS] = 3 * tflops / train_s
            out[Metric.LOG_PROBS_TFLOPS] = tflops / max(out[Metric.LOG_PROBS_SECONDS], 1e-9)
        return out

    def prepare(self, samples: list[TrainSample], rollout_id: int = 0, version: int = 0) -> dict[str, Any]:
        """Fill every sample's log-probs, values and advantages; returns their metrics."""
        cfg, ids = self.config, list(range(len(samples)))
        old = (self.old_actor.log_probs(samples, ids, version) if self.old_actor
               else self.backend.log_probs(samples, ids, "actor", with_entropy=True))
        for i, s in enumerate(samples):
            s.old_log_probs = old[i][0]
        out: dict[str, Any] = {}
        if cfg.on_policy_tolerance is not None:
            out["logp_mismatch_max"] = check_on_policy(samples, cfg.on_policy_tolerance, version)
        if cfg.ref_model:
            ref = self.backend.log_probs(samples, ids, "ref")
            for i, s in enumerate(samples):
                s.ref_log_probs = ref[i][0]
        if cfg.teacher:
            teacher = self.backend.log_probs(samples, ids, "teacher")
            for i, s in enumerate(samples):
                s.teacher_log_probs = teacher[i][0]
            out["teacher_kl"] = masked_token_mean([old[i][0] - teacher[i][0] for i in ids], samples)
        if cfg.critic:
            values = self.backend.values(samples, ids)
            for i, s in enumerate(samples):
                s.values = values[i]
        if self.plugins.custom_advantage is not None:
            self._custom_advantages(samples)
        else:
            self.advantages(samples)
        if self.plugins.data_postprocess is not None:
            batch = rollout_batch(samples)
            self.plugins.data_postprocess(self.plugins.args, rollout_id, batch)
            write_back(batch, samples, "--rollout-data-postprocess-path")
        entropies = [old[i][1] for i in ids]  # asked for: never None
        out["entropy"] = masked_token_mean(cast(list[torch.Tensor], entropies), samples)
        return out

    def _custom_advantages(self, samples: list[TrainSample]) -> None:
        """slime's: the per-token KL to the reference ("kl"; zeros without --kl-coef), then the
        plug-in sets the advantages and returns."""
        assert self.plugins.custom_advantage is not None
        kl = [torch.zeros(s.response_length) for s in samples]
        if self.config.kl_coef:
            per_token = adv.kl(rl_step.padded_field(samples, "old_log_probs"),
                               rl_step.padded_field(samples, "ref_log_probs"), self.loss.kl_loss_type)
            kl = [row[:s.response_length] for row, s in zip(per_token, samples)]
        batch = {**rollout_batch(samples), "kl": kl}
        self.plugins.custom_advantage(self.plugins.args, batch)
        if "advantages" not in batch:
            raise ValueError("--custom-advantage-function-path must set rollout_data['advantages'] (and 'returns')")
        write_back(batch, samples, "--custom-advantage-function-path")

    def optimize(self, rollout_id: int, samples: list[TrainSample]) -> dict[str, float]:
        """The optimizer steps over the rollout's global batches; their metrics, averaged."""
        cfg, ids = self.config, list(range(len(samples)))
        totals: dict[str, float] = {}
        steps = [ids[i:i + cfg.global_batch_size] for i in range(0, len(ids), cfg.global_batch_size)]
        for step_id, batch in enumerate(steps):
            self.heartbeat(Phase.TRAIN, rollout_id)  # the train timeout is per optimizer step
            with self.profiler.step(f"rollout={rollout_id} step={step_id}"):
                pack_loss = (make_slime_pack_loss(self.loss, self.plugins.loss, samples, batch) if self.plugins.loss
                             else rl_step.make_pack_loss(self.loss, samples, batch))
                step_metrics = self.backend.train_step(samples, batch, pack_loss, cfg.need_entropy,
                                                       rollout_id=rollout_id, step_id=step_id)
            if cfg.critic:
                critic_loss = rl_step.make_value_pack_loss(cfg.value_clip, cfg.per_token_loss, samples, batch)
                critic_metrics = self.backend.train_step(samples, batch, critic_loss, False, role="critic")
                step_metrics.update(value_loss=critic_metrics["value_loss"],
                                    value_clipfrac=critic_metrics["value_clipfrac"],
                                    critic_grad_norm=critic_metrics["grad_norm"])
            self.profiler.after_step()
            for name, value in step_metrics.items():
                totals[name] = totals.get(name, 0.0) + value / len(steps)
        return totals


def check_on_policy(samples: list[TrainSample], tolerance: float, version: int | None = None) -> float:
    worst = logp_mismatch(samples)
    if worst > tolerance:
        raise OffPolicyError(f"--true-on-policy-mode: max |logp_train - logp_rollout| = {worst:.3g} exceeds "
                             f"--true-on-policy-tolerance {tolerance:g}: the trainer "
                             f"and the engines no longer compute the same distribution ({_worst_token(samples)}; "
                             f"the trainer's weight version {version})")
    return worst


def _worst_token(samples: list[TrainSample]) -> str:
    """Where logp_mismatch's maximum is: which sample and token, both log-probs, its weight version."""
    def gap(s: TrainSample) -> torch.Tensor:
        assert s.old_log_probs is not None and s.rollout_log_probs is not None  # (logp_mismatch checked)
        return (s.old_log_probs - s.rollout_log_probs).abs() * s.loss_mask
    k, s = max(enumerate(samples), key=lambda item: float(gap(item[1]).max()) if item[1].response_length else 0.0)
    token = int(gap(s).argmax())
    assert s.old_log_probs is not None and s.rollout_log_probs is not None
    return (f"sample {s.sample_index if s.sample_index is not None else k}, response token {token} "
            f"(id {int(s.tokens[s.prompt_length + token])}): logp_train {float(s.old_log_probs[token]):.7g}, "
            f"logp_rollout {float(s.rollout_log_probs[token]):.7g}, generated at weight version {s.weight_version}")


def masked_token_mean(values: list[torch.Tensor], samples: list[TrainSample]) -> float:
    """The mean of per-token values over every counted response token of the rollout."""
    total = sum(float((v * s.loss_mask).sum()) for v, s in zip(values, samples))
    return total / max(1.0, sum(float(s.loss_mask.sum()) for s in samples))


def logp_mismatch(samples: list[TrainSample]) -> float:
    """max |logp_train - logp_rollout| over every counted response token."""
    worst = 0.0
    for s in samples:
        trained, generated = s.old_log_probs, s.rollout_log_probs
        if trained is None or generated is None or generated.shape != trained.shape:
            raise OffPolicyError("--true-on-policy-mode needs the engines' log-prob of every response token")
        diff = (trained - generated).abs() * s.loss_mask
        worst = max(worst, float(diff.max()) if diff.numel() else 0.0)
    return worst
