"""The megatron backend: a megatron-core GPTModel (TP/SP/EP/DP), packed micro-batches, and a
torch optimizer sharded over data-parallel ranks (trainer.megatron.optimizer).

Runs on CPU through gloo (ckpt_tools.megatron_compat) and on GPU through NCCL. Parameters are fp32,
or with --bf16 bf16 (as megatron's --bf16: the model built in bf16) with fp32 gradients
(trainer.main_grads) and fp32 master weights in the optimizer; gradients are reduced here by hand,
in fp32, as megatron's DDP does with its main grads.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel
from megatron.core.models.gpt import GPTModel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

from ckpt_tools import mapping
from ckpt_tools.megatron_model import init_parallel, transformer_config_from_hf, with_mtp_layers
from rollout.plugins import load_function
from trainer import context_parallel, freezing, main_grads
from trainer.args import ArgsError
from trainer.backend import Backend, PackLoss, built, steps_on
from trainer.batch import Batching, Pack, TrainSample, rank_packs, schedule
from trainer.config import TrainerConfig
from trainer.host_to_device import to_device
from trainer.lr_schedule import lr_lambda
from trainer.megatron import grad_sync, trainee_state
from trainer.megatron import mtp as megatron_mtp
from trainer.megatron import pipeline as megatron_pipeline
from trainer.megatron import state as megatron_state
from trainer.megatron.attention import gpt_block_spec
from trainer.megatron.compile import compile_layers
from trainer.megatron.expert_bias import update_expert_bias
from trainer.megatron.hf_export import HFExport
from trainer.megatron.norm import HiddenStateNorm
from trainer.megatron.optimizer import ShardedOptimizer
from trainer.megatron.rope import PackedRope
from trainer.megatron.trainee_state import Trainee
from trainer.numerics import attention_kernels, check_attention_backend
from trainer.offload import Offloadable
from trainer.profiling import phase
from trainer.token_stats import chunked_log_probs_and_entropy, log_probs_and_entropy

log = logging.getLogger(__name__)


class ValueHead(torch.nn.Module):
    """Hidden state -> scalar value, in place of GPTModel's output layer (same call signature).
    Replicated on every TP rank: its input is the full hidden state (gathered over the sequence
    under sequence parallelism), so every rank computes the same gradient. Starts at zero."""

    def __init__(self, hidden_size: int, sequence_parallel: bool) -> None:
        super().__init__()
        self.sequence_parallel = sequence_parallel
        # Named weight and bias, as the layer it replaces: GPTModel's checkpoint code expects them.
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden_size))
        self.bias = torch.nn.Parameter(torch.zeros(1))

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor | None = None,
                runtime_gather_output: bool | None = None) -> tuple[torch.Tensor, None]:
        if self.sequence_parallel:
            hidden = tensor_parallel.gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
        return torch.nn.functional.linear(hidden, self.weight, self.bias), None


class MegatronBackend(Backend):
    def __init__(self, config: TrainerConfig, hf_config: dict[str, Any]) -> None:
        self.config = config
        parallel = config.parallel
        init_parallel(parallel.tensor_model_parallel_size, parallel.expert_model_parallel_size, config.model.seed,
                      parallel.expert_tensor_parallel_size, parallel.context_parallel_size,
                      parallel.pipeline_model_parallel_size)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.dp_rank, self.dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        self.tp_rank, self.tp_size = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
        self.etp_size = ps.get_expert_tensor_parallel_world_size()
        self.cp_rank, self.cp_size = ps.get_context_parallel_rank(), ps.get_context_parallel_world_size()
        self.pp_size, self.last_stage = ps.get_pipeline_model_parallel_world_size(), ps.is_pipeline_last_stage()
        # As in Megatron-LM, --sequence-parallel with TP = 1 is accepted and changes nothing.
        self.sequence_parallel = config.parallel.sequence_parallel and self.tp_size > 1
        self.cpu_group = dist.new_group(backend="gloo")
        self.save_optimizer = not config.checkpoint.no_save_optim
        self.device = (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
                       else torch.device("cpu"))
        check_attention_backend(config.model.attention_kernels, self.device, "megatron", parallel.context_parallel_size)
        self.hf_config = hf_config
        self.mtp_layers = config.model.mtp_num_layers or 0
        self.shape = mapping.ModelShape.from_hf_config(
            hf_config, config.model.make_vocab_size_divisible_by * self.tp_size, self.mtp_layers)
        self.plugin_args = config.plugin_namespace()  # what slime's megatron hooks get as args
        if config.model.custom_megatron_init_path:  # slime's: once megatron is initialised, before any model is built
            init = load_function(config.model.custom_megatron_init_path, "--custom-megatron-init-path")
            init(self.plugin_args)
        self.actor = self._trainee(freezing.frozen(self._build_model(), config.model), config.optimizer.lr)
        self.model = self.actor.model
        self.ref_model = self._build_model() if config.loss.ref_model_needed else None
        # On-policy distillation's teacher: frozen, the student's architecture, its own weights.
        self.teacher_model = self._build_model() if config.checkpoint.opd_teacher_load else None
        critic_lr = config.optimizer.critic_lr or config.optimizer.lr
        self.critic = (self._trainee(freezing.frozen(self._build_critic(), config.model), critic_lr)
                       if config.loss.advantage_estimator == "ppo" else None)
        # The log-probs over the vocabulary read and write [tokens, vocab] fp32 tensors a dozen
        # times; compiled, they fuse into a few passes. Under TP the collectives stay eager.
        stats = torch.compile(log_probs_and_entropy, dynamic=True) \
            if config.model.torch_compile and self.tp_size == 1 else log_probs_and_entropy
        self._token_stats = functools.partial(chunked_log_probs_and_entropy, stats=stats,
                                              chunk_size=config.model.log_probs_chunk_size)
        self._hooks = {name: load_function(path, flag) for name, path, flag in (
            ("log_prob", config.model.custom_megatron_before_log_prob_hook_path,
             "--custom-megatron-before-log-prob-hook-path"),
            ("train_step", config.model.custom_megatron_before_train_step_hook_path,
             "--custom-megatron-before-train-step-hook-path")) if path}

    def offloadable(self) -> Offloadable:
        trainees = [t for t in (self.actor, self.critic) if t is not None]
        models = [t.model for t in trainees] + [m for m in (self.ref_model, self.teacher_model) if m is not None]
        # --optimizer-cpu-offload keeps its state on the host already: moving it changes nothing
        return Offloadable(models, [t.optimizer.optimizer for t in trainees], self.device,
                           [m for t in trainees for m in t.optimizer.device_masters()])

    # ---------------------------------------------------------------- model
    def _build_model(self, tied: bool | None = None) -> GPTModel:
        options = self.config
        config, model_kwargs = transformer_config_from_hf(
            self.hf_config, self.tp_size, options.parallel.expert_model_parallel_size,
            options.model.make_vocab_size_divisible_by, sequence_parallel=self.sequence_parallel, etp=self.etp_size,
            cp=self.cp_size, pp=self.pp_size, pp_first=options.parallel.decoder_first_pipeline_num_layers,
            pp_last=options.parallel.decoder_last_pipeline_num_layers,
            params_dtype=torch.bfloat16 if options.model.bf16 else torch.float32, mtp_layers=self.mtp_layers)
        config.mtp_loss_scaling_factor = options.model.mtp_loss_scaling_factor
        if tied is not None:
            model_kwargs["share_embeddings_and_output_weights"] = tied
        # megatron's torch.compile'd SwiGLU: a GPU fusion that needs no TransformerEngine.
        config.bias_activation_fusion = self.device.type == "cuda"
        config.recompute_granularity = options.parallel.recompute_granularity
        config.recompute_method = options.parallel.recompute_method
        config.recompute_num_layers = options.parallel.recompute_num_layers
        if config.num_moe_experts:
            if options.model.moe_token_dispatcher_type == "alltoall" and self.device.type != "cuda":
                raise ArgsError("--moe-token-dispatcher-type alltoall needs CUDA streams; use allgather on CPU")
            config.moe_token_dispatcher_type = options.model.moe_token_dispatcher_type or "allgather"
            config.moe_router_dtype = options.model.moe_router_dtype
            config.moe_router_bias_update_rate = options.model.moe_router_bias_update_rate
        spec = gpt_block_spec(config, options.model.attention_backend, self.shape.post_norms, self.shape.full_qk_norm,
                              options.model.qwen_gdn_backend, self.shape.split_gdn_projections)
        last = spec.submodules.layer_specs[-1] if isinstance(spec.submodules, TransformerBlockSubmodules) else spec
        model = with_mtp_layers(config, spec, last, HiddenStateNorm, model_kwargs, self.shape.vocab_size,
                                pre_process=ps.is_pipeline_first_stage(), post_process=self.last_stage).to(self.device)
        # MLA's layers keep their own rotary tables (YaRN's among them) and rotate packed rows by megatron's path
        if options.model.attention_backend != "local" and self.cp_size == 1 and not config.multi_latent_attention:
            model.packed_rope = PackedRope(model)
        if options.model.torch_compile:
            compile_layers(model, max(self.tp_size, self.etp_size, options.parallel.expert_model_parallel_size) > 1)
        return model

    def _build_critic(self) -> GPTModel:
        """The actor's architecture with a scalar value head instead of the vocabulary projection."""
        critic = self._build_model(tied=False)
        if self.last_stage:
            critic.output_layer = ValueHead(self.shape.hidden_size, self.sequence_parallel).to(
                self.device, torch.bfloat16 if self.config.model.bf16 else torch.float32)
        return critic

    def _trainee(self, model: GPTModel, lr: float) -> Trainee:
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        main_grads.accumulate_in_fp32(p for _, p in named)  # before the overlap's hooks: they read main_grad
        optimizer = ShardedOptimizer(named, self.config.optimizer, lr, grad_sync.data_parallel_group,
                                     grad_sync.is_expert)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer.optimizer, lr_lambda(self.config.optimizer))
        parallel = self.config.parallel
        return Trainee(model, optimizer, schedule,
                       grad_sync.data_parallel_grads(named, parallel.ddp_bucket_size, parallel.overlap_grad_reduce))

    def _layout(self, pack: Pack, samples: list[TrainSample], mtp: bool = False) -> context_parallel.RowLayout:
        """This rank's rows of `pack`; with `mtp`, what the MTP loss weighs each token by too."""
        rows = context_parallel.layout(pack, samples, self.tp_size if self.sequence_parallel else 1,
                                       ps.get_context_parallel_group() if self.cp_size > 1 else None)
        return megatron_mtp.weighted(rows, [samples[i].loss_mask for i in pack.sample_ids]) if mtp else rows

    def _run_model(self, model: GPTModel, rows: context_parallel.RowLayout) -> torch.Tensor:
        """The model's output for this rank's rows: on the last stage its vocab slice of the logits,
        [1, t, V / tp]; on other pipeline stages the hidden states for the next."""
        tokens, positions = to_device(rows.tokens, self.device)[None], to_device(rows.positions, self.device)[None]
        cu = rows.cu_seqlens
        inputs: dict[str, Any] = {}
        if self.config.model.attention_backend == "local":
            # Block-diagonal causal mask (True = masked): no sample sees another.
            seq = to_device(torch.repeat_interleave(torch.arange(len(cu) - 1), (cu[1:] - cu[:-1]).long()), self.device)
            causal = torch.ones(seq.numel(), seq.numel(), dtype=torch.bool, device=self.device).triu(1)
            inputs["attention_mask"] = (causal | (seq[:, None] != seq[None, :]))[None, None]
        else:  # the fused path takes the sample boundaries themselves (THD layout)
            # cu stays on the CPU: megatron's per-sample RoPE reads it with .tolist()
            longest = int((cu[1:] - cu[:-1]).max())
            inputs["attention_mask"] = None
            inputs["packed_seq_params"] = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                                          max_seqlen_q=longest, max_seqlen_kv=longest)
        if rows.token_weights is not None:
            targets = megatron_mtp.targets(rows.tokens, rows.token_weights, cu, self.mtp_layers)
            inputs["mtp_targets"] = [(to_device(t, self.device), to_device(w, self.device)) for t, w in targets]
        rope: PackedRope | None = getattr(model, "packed_rope", None)
        if rope is not None:
            rope.positions = positions[0]
        try:
            bf16 = self.config.model.bf16 and self.device.type == "cuda"
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=bf16), \
                    attention_kernels(self.config.model.attention_kernels):
                return model(tokens, positions, **inputs)
        finally:
            if rope is not None:
                rope.positions = None

    def _stats(self, logits: torch.Tensor, rows: context_parallel.RowLayout,
               with_entropy: bool) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """Per-sample response log-probs (and entropies) from this rank's logits of `rows`."""
        vocab_local = logits.shape[-1]
        start = self.tp_rank * vocab_local
        valid = max(0, min(vocab_local, self.shape.vocab_size - start))
        group = ps.get_tensor_model_parallel_group() if self.tp_size > 1 else None
        logp, ent = self._token_stats(logits[to_device(rows.rows, self.device)], to_device(rows.targets, self.device),
                                      start, valid, group, with_entropy)
        return rows.per_sample(logp), (rows.per_sample(ent) if ent is not None else None)

    def _each_pack(self, model: GPTModel, samples: list[TrainSample], ids: list[int],
                   step: megatron_pipeline.PackStep, trainee: Trainee | None = None) -> list[dict[str, torch.Tensor]]:
        """Forward only, or the forward and backward of `trainee`'s model."""
        train = trainee is not None
        mtp = train and model is self.model and self.config.model.enable_mtp_training
        packs = [(pack, self._layout(pack, samples, mtp)) for pack in self._my_packs(samples, ids, not train)]
        if trainee is None:
            return megatron_pipeline.each_pack(model, packs, self._run_model, step, train=False)
        return megatron_pipeline.each_pack(model, packs, self._run_model, step, True, trainee.grads.no_sync)

    def _my_packs(self, samples: list[TrainSample], ids: list[int], for_log_probs: bool) -> list[Pack]:
        """The packs of this data-parallel rank."""
        return rank_packs(samples, ids, self.dp_size, self.dp_rank,
                          Batching.of(self.config.batching, for_log_probs, self.cp_size))

    # ---------------------------------------------------------------- Backend
    def _values_of(self, output: torch.Tensor, rows: context_parallel.RowLayout) -> list[torch.Tensor]:
        return rows.per_sample(output[0, ..., 0].float()[to_device(rows.rows, self.device)])

    def _gather_per_sample(self, mine: dict[int, Any]) -> dict[int, Any]:
        gathered: list[dict] = [{} for _ in range(self.world_size)]
        dist.all_gather_object(gathered, mine, group=self.cpu_group)
        return {i: v for part in gathered for i, v in part.items()}

    @torch.no_grad()
    def log_probs(self, samples: list[TrainSample], ids: list[int], model: str = "actor",
                  with_entropy: bool = False) -> dict[int, tuple[torch.Tensor, torch.Tensor | None]]:
        net = {"actor": self.model, "ref": self.ref_model, "teacher": self.teacher_model}[model]
        if net is None:
            raise RuntimeError(f"no {model} model was loaded")
        if "log_prob" in self._hooks:  # slime's signature: the model's chunks and where its log-probs go
            self._hooks["log_prob"](self.plugin_args, [net], "" if model == "actor" else f"{model}_")
        net.eval()
        mine: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}

        def collect(pack: Pack, rows: context_parallel.RowLayout, output: torch.Tensor):
            logps, ents = self._stats(output[0], rows, with_entropy)
            for k, i in enumerate(pack.sample_ids):  # kept on the device: a copy per pack would drain the GPU
                mine[i] = (logps[k], ents[k] if ents is not None else None)
            return output.new_zeros(()), {}

        self._each_pack(net, samples, ids, collect)
        return self._gather_per_sample({i: (logp.cpu(), ent.cpu() if ent is not None else None)
                                        for i, (logp, ent) in mine.items()})

    @torch.no_grad()
    def values(self, samples: list[TrainSample], ids: list[int]) -> dict[int, torch.Tensor]:
        critic = built(self.critic, "the critic (--advantage-estimator ppo)")
        critic.model.eval()
        mine: dict[int, torch.Tensor] = {}

        def collect(pack: Pack, rows: context_parallel.RowLayout, output: torch.Tensor):
            mine.update(zip(pack.sample_ids, self._values_of(output, rows)))
            return output.new_zeros(()), {}

        self._each_pack(critic.model, samples, ids, collect)
        return self._gather_per_sample({i: v.cpu() for i, v in mine.items()})

    def train_step(self, samples: list[TrainSample], ids: list[int], loss: PackLoss,
                   need_entropy: bool, role: str = "actor", rollout_id: int = 0, step_id: int = 0) -> dict[str, float]:
        trainee = built(self.critic, "the critic (--advantage-estimator ppo)") if role == "critic" else self.actor
        if "train_step" in self._hooks and role == "actor":  # slime's signature
            self._hooks["train_step"](self.plugin_args, rollout_id, step_id, [self.model], self.actor.optimizer,
                                      self.actor.scheduler)
        trainee.model.train()
        with phase("zero_grad"):
            trainee.optimizer.zero_grad()
            trainee.grads.start()
        totals: dict[str, torch.Tensor] = {}
        mtp = role == "actor" and self.config.model.enable_mtp_training
        if mtp:
            every_rank = schedule([samples[i].tokens.numel() for i in ids], self.dp_size,
                                  Batching.of(self.config.batching, cp_size=self.cp_size))
            packs = megatron_mtp.weigh_micro_batches(sum(len(packs) for packs in every_rank))

        def step(pack: Pack, rows: context_parallel.RowLayout, output: torch.Tensor):
            if role == "critic":
                return loss(pack, self._values_of(output, rows), None)
            value, metrics = loss(pack, *self._stats(output[0], rows, need_entropy))
            if mtp:
                metrics = {**metrics, **megatron_mtp.metrics(trainee.model, packs)}
            return value, metrics

        with phase("packs"):
            for metrics in self._each_pack(trainee.model, samples, ids, step, trainee):
                for name, m in metrics.items():  # summed on the device: a copy to the host per pack would drain it
                    totals[name] = totals.get(name, 0.0) + m.detach().float()
        with phase("grad_reduce"):
            grad_sync.reduce_gradients(trainee.model, trainee.grads, self.sequence_parallel)
            update_expert_bias(trainee.model)
        with phase("grad_norm"):
            grad_norm = grad_sync.grad_norm(trainee.model, self.tp_rank, self.device)
        opt = self.config.optimizer
        lr = trainee.scheduler.get_last_lr()[0]
        if steps_on(grad_norm, role, opt.check_for_nan_in_loss_and_grad):  # (the next step zeroes the grads)
            with phase("optimizer"):
                if opt.clip_grad > 0 and grad_norm > opt.clip_grad:
                    grads = [g for p in trainee.model.parameters() if (g := main_grads.grad_of(p)) is not None]
                    torch._foreach_mul_(grads, opt.clip_grad / (grad_norm + 1e-6))
                trainee.optimizer.step()
                trainee.scheduler.step()
        with phase("metrics"):
            host_totals = {name: total.cpu() for name, total in totals.items()}
            summed = self._sum_over_data_parallel(host_totals)
        return {**summed, "grad_norm": float(grad_norm), "lr": float(lr)}

    def _sum_over_data_parallel(self, totals: dict[str, torch.Tensor]) -> dict[str, float]:
        # Ranks with no samples, and pipeline stages before the last, still join.
        gathered: list[list[str]] = [[] for _ in range(self.world_size)]
        dist.all_gather_object(gathered, sorted(totals), group=self.cpu_group)
        names = sorted(set().union(*gathered))
        values = torch.stack([torch.as_tensor(totals.get(n, 0.0), dtype=torch.float64) for n in names]) \
            if names else torch.zeros(0, dtype=torch.float64)
        # One TP and CP rank per data-parallel rank contributes, so each sample is counted once.
        if self.tp_rank != 0 or self.cp_rank != 0 or not self.last_stage:
            values.zero_()
        dist.all_reduce(values, group=self.cpu_group)
        return {n: float(v) for n, v in zip(names, values)}

    # ---------------------------------------------------------------- weights
    def hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        return HFExport(self.model, self.shape, self.hf_config, self.tp_size, self.etp_size,
                        self.config.parallel.expert_model_parallel_size, self.pp_size).weights()

    # ---------------------------------------------------------------- checkpoints
    def save(self, ckpt_dir: Path, common: dict[str, Any]) -> None:
        trainee_state.save(ckpt_dir, self.actor, self.critic, common, self.save_optimizer)

    def load(self, ckpt_dir: Path, weights_only: bool) -> dict[str, Any]:
        return trainee_state.load(ckpt_dir, self.actor, self.critic, weights_only)

    def load_teacher(self, ckpt_dir: Path) -> None:
        teacher = built(self.teacher_model, "the teacher (--opd-teacher-load)")
        megatron_state.load_megatron(ckpt_dir, teacher, None)
        teacher.requires_grad_(False)

    def load_reference(self, ckpt_dir: Path) -> None:
        reference = built(self.ref_model, "the reference model (--ref-load, needed by the loss)")
        megatron_state.load_megatron(ckpt_dir, reference, None)
        reference.requires_grad_(False)
