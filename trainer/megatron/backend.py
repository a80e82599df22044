"""The megatron backend: a megatron-core GPTModel (TP/SP/EP/DP), packed micro-batches, and a
torch optimizer sharded over data-parallel ranks (trainer.megatron.optimizer).

Runs on CPU through gloo (ckpt_tools.megatron_compat) and on GPU through NCCL. Parameters are fp32,
or with --bf16 bf16 (as megatron's --bf16: the model built in bf16) with fp32 gradients
(trainer.main_grads) and fp32 master weights in the optimizer; gradients are reduced here by hand,
in fp32, as megatron's DDP does with its main grads.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel
from megatron.core.models.gpt import GPTModel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.module import param_is_not_shared
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from ckpt_tools import mapping
from ckpt_tools.megatron_model import init_parallel, transformer_config_from_hf
from rollout.plugins import load_function
from trainer import context_parallel, main_grads
from trainer.megatron import pipeline as megatron_pipeline, state as megatron_state
from trainer.args import ArgsError
from trainer.backend import Backend, PackLoss, check_finite
from trainer.batch import Batching, Pack, TrainSample, rank_packs
from trainer.lr_schedule import lr_lambda
from trainer.megatron.attention import gpt_block_spec
from trainer.megatron.compile import compile_layers
from trainer.megatron.optimizer import ShardedOptimizer
from trainer.megatron.rope import PackedRope
from trainer.offload import Offloadable
from trainer.numerics import attention_kernels, check_attention_backend
from trainer.token_stats import log_probs_and_entropy

log = logging.getLogger(__name__)

# The local layer spec names two norms differently from the checkpoint (and ckpt_tools.mapping).
_LOCAL_NAMES = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
                "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}
_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
_EXPERT = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.(.+)")


CRITIC_DIR = "critic"  # PPO's critic is saved in this sub-folder of each checkpoint


@dataclass
class Trainee:
    """A model with its own optimizer and LR schedule (the actor; PPO's critic)."""

    model: GPTModel
    optimizer: ShardedOptimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler


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
    def __init__(self, args: argparse.Namespace, hf_config: dict[str, Any]) -> None:
        self.args = args
        init_parallel(args.tensor_model_parallel_size, args.expert_model_parallel_size, args.seed,
                      args.expert_tensor_parallel_size, args.context_parallel_size, args.pipeline_model_parallel_size)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.dp_rank, self.dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        self.tp_rank, self.tp_size = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
        self.etp_size = ps.get_expert_tensor_parallel_world_size()
        self.cp_rank, self.cp_size = ps.get_context_parallel_rank(), ps.get_context_parallel_world_size()
        self.pp_size, self.last_stage = ps.get_pipeline_model_parallel_world_size(), ps.is_pipeline_last_stage()
        # As in Megatron-LM, --sequence-parallel with TP = 1 is accepted and changes nothing.
        self.sequence_parallel = args.sequence_parallel and self.tp_size > 1
        self.cpu_group = dist.new_group(backend="gloo")
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        check_attention_backend(args.attention_kernels, self.device)
        self.hf_config = hf_config
        self.shape = mapping.ModelShape.from_hf_config(hf_config, args.make_vocab_size_divisible_by * self.tp_size)
        if args.custom_megatron_init_path:  # slime's: once megatron is initialised, before any model is built
            load_function(args.custom_megatron_init_path, "--custom-megatron-init-path")(args)
        self.actor = self._trainee(self._build_model(), args.lr)
        self.model = self.actor.model
        self.ref_model = self._build_model() if args.ref_model_needed else None
        # On-policy distillation's teacher: frozen, the student's architecture, its own weights.
        self.teacher_model = self._build_model() if args.opd_teacher_load else None
        self.critic = self._trainee(self._build_critic(), args.critic_lr or args.lr) \
            if args.advantage_estimator == "ppo" else None
        # The log-probs over the vocabulary read and write [tokens, vocab] fp32 tensors a dozen
        # times; compiled, they fuse into a few passes. Under TP the collectives stay eager.
        self._token_stats = torch.compile(log_probs_and_entropy, dynamic=True) \
            if args.torch_compile and self.tp_size == 1 else log_probs_and_entropy
        self._hooks = {name: load_function(path, flag) for name, path, flag in (
            ("log_prob", args.custom_megatron_before_log_prob_hook_path, "--custom-megatron-before-log-prob-hook-path"),
            ("train_step", args.custom_megatron_before_train_step_hook_path,
             "--custom-megatron-before-train-step-hook-path")) if path}

    def offloadable(self) -> Offloadable:
        trainees = [t for t in (self.actor, self.critic) if t is not None]
        models = [t.model for t in trainees] + [m for m in (self.ref_model, self.teacher_model) if m is not None]
        # --optimizer-cpu-offload keeps its state on the host already: moving it changes nothing
        return Offloadable(models, [t.optimizer.optimizer for t in trainees], self.device,
                           [m for t in trainees for m in t.optimizer.device_masters()])

    # ---------------------------------------------------------------- model
    def _build_model(self, tied: bool | None = None) -> GPTModel:
        args = self.args
        config, model_kwargs = transformer_config_from_hf(
            self.hf_config, self.tp_size, args.expert_model_parallel_size, args.make_vocab_size_divisible_by,
            sequence_parallel=self.sequence_parallel, etp=self.etp_size, cp=self.cp_size, pp=self.pp_size,
            pp_first=args.decoder_first_pipeline_num_layers, pp_last=args.decoder_last_pipeline_num_layers,
            params_dtype=torch.bfloat16 if args.bf16 else torch.float32)
        if tied is not None:
            model_kwargs["share_embeddings_and_output_weights"] = tied
        # megatron's torch.compile'd SwiGLU: a GPU fusion that needs no TransformerEngine.
        config.bias_activation_fusion = self.device.type == "cuda"
        config.recompute_granularity = args.recompute_granularity
        config.recompute_method = args.recompute_method
        config.recompute_num_layers = args.recompute_num_layers
        if config.num_moe_experts:
            if args.moe_token_dispatcher_type == "alltoall" and self.device.type != "cuda":
                raise ArgsError("--moe-token-dispatcher-type alltoall needs CUDA streams; use allgather on CPU")
            config.moe_token_dispatcher_type = args.moe_token_dispatcher_type or "allgather"
            config.moe_router_dtype = args.moe_router_dtype
        spec = gpt_block_spec(config, args.attention_backend)
        model = GPTModel(config=config, transformer_layer_spec=spec, pre_process=ps.is_pipeline_first_stage(),
                         post_process=self.last_stage, **model_kwargs).to(self.device)
        if args.attention_backend != "local" and self.cp_size == 1:
            model.packed_rope = PackedRope(model)
        if args.torch_compile:
            compile_layers(model)
        return model

    def _build_critic(self) -> GPTModel:
        """The actor's architecture with a scalar value head instead of the vocabulary projection."""
        critic = self._build_model(tied=False)
        if self.last_stage:
            critic.output_layer = ValueHead(self.shape.hidden_size, self.sequence_parallel).to(
                self.device, torch.bfloat16 if self.args.bf16 else torch.float32)
        return critic

    def _trainee(self, model: GPTModel, lr: float) -> Trainee:
        def data_parallel_group(expert: bool) -> dist.ProcessGroup:
            return ps.get_expert_data_parallel_group() if expert else ps.get_data_parallel_group(with_context_parallel=True)

        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        main_grads.accumulate_in_fp32(p for _, p in named)
        optimizer = ShardedOptimizer(named, self.args, lr, data_parallel_group, _is_expert)
        return Trainee(model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer.optimizer, lr_lambda(self.args)))

    def _layout(self, pack: Pack, samples: list[TrainSample]) -> context_parallel.RowLayout:
        return context_parallel.layout(pack, samples, self.tp_size if self.sequence_parallel else 1,
                                       ps.get_context_parallel_group() if self.cp_size > 1 else None)

    def _run_model(self, model: GPTModel, rows: context_parallel.RowLayout) -> torch.Tensor:
        """The model's output for this rank's rows: on the last stage its vocab slice of the logits,
        [1, t, V / tp]; on other pipeline stages the hidden states for the next."""
        tokens, positions, cu = rows.tokens.to(self.device)[None], rows.positions.to(self.device)[None], rows.cu_seqlens
        inputs: dict[str, Any] = {}
        if self.args.attention_backend == "local":
            # Block-diagonal causal mask (True = masked): no sample sees another.
            seq = torch.repeat_interleave(torch.arange(len(cu) - 1), (cu[1:] - cu[:-1]).long()).to(self.device)
            causal = torch.ones(seq.numel(), seq.numel(), dtype=torch.bool, device=self.device).triu(1)
            inputs["attention_mask"] = (causal | (seq[:, None] != seq[None, :]))[None, None]
        else:  # the fused path takes the sample boundaries themselves (THD layout)
            # cu stays on the CPU: megatron's per-sample RoPE reads it with .tolist()
            longest = int((cu[1:] - cu[:-1]).max())
            inputs["attention_mask"] = None
            inputs["packed_seq_params"] = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                                          max_seqlen_q=longest, max_seqlen_kv=longest)
        rope: PackedRope | None = getattr(model, "packed_rope", None)
        if rope is not None:
            rope.positions = positions[0]
        try:
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.args.bf16 and self.device.type == "cuda"), \
                    attention_kernels(self.args.attention_kernels):
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
        logp, ent = self._token_stats(logits[rows.rows.to(self.device)], rows.targets.to(self.device), start, valid,
                                      group, with_entropy)
        return rows.per_sample(logp), (rows.per_sample(ent) if ent is not None else None)

    def _each_pack(self, model: GPTModel, samples: list[TrainSample], ids: list[int],
                   step: megatron_pipeline.PackStep, train: bool) -> list[dict[str, torch.Tensor]]:
        packs = [(pack, self._layout(pack, samples)) for pack in self._my_packs(samples, ids, not train)]
        return megatron_pipeline.each_pack(model, packs, self._run_model, step, train)

    def _my_packs(self, samples: list[TrainSample], ids: list[int], for_log_probs: bool) -> list[Pack]:
        batching = Batching.from_args(self.args, for_log_probs)
        if batching.dynamic and self.cp_size > 1:  # as slime: each rank holds 1 / CP of a pack's tokens
            batching = dataclasses.replace(batching, max_tokens=batching.max_tokens * self.cp_size)
        return rank_packs(samples, ids, self.dp_size, self.dp_rank, batching)

    # ---------------------------------------------------------------- Backend
    def _values_of(self, output: torch.Tensor, rows: context_parallel.RowLayout) -> list[torch.Tensor]:
        return rows.per_sample(output[0, ..., 0].float()[rows.rows.to(self.device)])

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
            self._hooks["log_prob"](self.args, [net], "" if model == "actor" else f"{model}_")
        net.eval()
        mine: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}

        def collect(pack: Pack, rows: context_parallel.RowLayout, output: torch.Tensor):
            logps, ents = self._stats(output[0], rows, with_entropy)
            for k, i in enumerate(pack.sample_ids):
                mine[i] = (logps[k].cpu(), ents[k].cpu() if ents is not None else None)
            return output.new_zeros(()), {}

        self._each_pack(net, samples, ids, collect, train=False)
        return self._gather_per_sample(mine)

    @torch.no_grad()
    def values(self, samples: list[TrainSample], ids: list[int]) -> dict[int, torch.Tensor]:
        self.critic.model.eval()
        mine = {}

        def collect(pack: Pack, rows: context_parallel.RowLayout, output: torch.Tensor):
            mine.update((i, v.cpu()) for i, v in zip(pack.sample_ids, self._values_of(output, rows)))
            return output.new_zeros(()), {}

        self._each_pack(self.critic.model, samples, ids, collect, train=False)
        return self._gather_per_sample(mine)

    def train_step(self, samples: list[TrainSample], ids: list[int], loss: PackLoss,
                   need_entropy: bool, role: str = "actor", rollout_id: int = 0, step_id: int = 0) -> dict[str, float]:
        trainee = self.critic if role == "critic" else self.actor
        if "train_step" in self._hooks and role == "actor":  # slime's signature
            self._hooks["train_step"](self.args, rollout_id, step_id, [self.model], self.actor.optimizer,
                                      self.actor.scheduler)
        trainee.model.train()
        trainee.optimizer.zero_grad()
        totals: dict[str, torch.Tensor] = {}

        def step(pack: Pack, rows: context_parallel.RowLayout, output: torch.Tensor):
            if role == "critic":
                return loss(pack, self._values_of(output, rows), None)
            return loss(pack, *self._stats(output[0], rows, need_entropy))

        for metrics in self._each_pack(trainee.model, samples, ids, step, train=True):
            for name, m in metrics.items():
                totals[name] = totals.get(name, 0.0) + m.detach().float().cpu()
        self._reduce_gradients(trainee.model)
        grad_norm = self._grad_norm(trainee.model)
        check_finite(grad_norm, role)
        if self.args.clip_grad > 0 and grad_norm > self.args.clip_grad:
            grads = [g for p in trainee.model.parameters() if (g := main_grads.grad_of(p)) is not None]
            torch._foreach_mul_(grads, self.args.clip_grad / (grad_norm + 1e-6))
        trainee.optimizer.step()
        lr = trainee.scheduler.get_last_lr()[0]
        trainee.scheduler.step()
        return {**self._sum_over_data_parallel(totals), "grad_norm": float(grad_norm), "lr": lr}

    def _reduce_gradients(self, model: GPTModel) -> None:
        """Sum gradients where several ranks hold parts of one: over the TP group, q/k layernorm
        weights (each rank normalises only its own heads) and, under sequence parallelism, weights
        marked sequence_parallel (norms, router: each rank sees its own slice of the sequence);
        then every replica over data-parallel x context-parallel ranks (the loss is already scaled
        for a sum; each CP rank holds the gradient of its own rows);
        expert weights over the expert-DP group."""
        megatron_pipeline.reduce_embedding_grads(model)
        named = [(n, p, g) for n, p in model.named_parameters() if (g := main_grads.grad_of(p)) is not None]
        partial = [g for n, p, g in named if "q_layernorm" in n or "k_layernorm" in n
                   or (self.sequence_parallel and getattr(p, "sequence_parallel", False))]
        _all_reduce_sum(partial, ps.get_tensor_model_parallel_group())
        _all_reduce_sum([g for n, _, g in named if not _is_expert(n)], ps.get_data_parallel_group(with_context_parallel=True))
        _all_reduce_sum([g for n, _, g in named if _is_expert(n)], ps.get_expert_data_parallel_group())

    def _grad_norm(self, model: GPTModel) -> float:
        """The global L2 norm: each TP shard once, replicated weights (norms) once per TP group,
        expert weights summed over the expert-parallel ranks that hold different experts."""
        squares = []
        for expert, group in ((False, ps.get_model_parallel_group()),
                              (True, ps.get_expert_tensor_model_pipeline_parallel_group())):
            grads = [g for n, p in model.named_parameters() if (g := main_grads.grad_of(p)) is not None and param_is_not_shared(p)
                     and _is_expert(n) == expert
                     and (getattr(p, "tensor_model_parallel", False) or self.tp_rank == 0 or expert)]
            sq = torch.zeros((), dtype=torch.float32, device=self.device)
            if grads:  # one kernel for all the per-tensor norms, not three per tensor
                sq += torch.stack(torch._foreach_norm([g.float() for g in grads])).pow(2).sum()
            if dist.get_world_size(group) > 1:
                dist.all_reduce(sq, group=group)
            squares.append(sq)
        return float(sum(squares).sqrt())

    def _sum_over_data_parallel(self, totals: dict[str, torch.Tensor]) -> dict[str, float]:
        # Ranks with no samples, and pipeline stages before the last, still join.
        names = [None] * self.world_size
        dist.all_gather_object(names, sorted(totals), group=self.cpu_group)
        names = sorted(set().union(*names))
        values = torch.stack([torch.as_tensor(totals.get(n, 0.0), dtype=torch.float64) for n in names]) \
            if names else torch.zeros(0, dtype=torch.float64)
        # One TP and CP rank per data-parallel rank contributes, so each sample is counted once.
        if self.tp_rank != 0 or self.cp_rank != 0 or not self.last_stage:
            values.zero_()
        dist.all_reduce(values, group=self.cpu_group)
        return {n: float(v) for n, v in zip(names, values)}

    # ---------------------------------------------------------------- weights
    def hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        rules = {rule.megatron: rule for rule in mapping.rules(self.shape)}
        dtype = getattr(torch, self.hf_config.get("torch_dtype") or self.hf_config.get("dtype") or "float32")
        if self.pp_size == 1:
            yield from self._stage_hf_weights(rules, dtype)
        else:
            yield from megatron_pipeline.from_every_stage(self._stage_hf_weights(rules, dtype))

    def _stage_hf_weights(self, rules: dict[str, mapping.Rule], dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
        """This pipeline stage's weights, on its leader (global rank 0 without PP)."""
        offset = get_transformer_layer_offset(self.model.config)
        for name, param in self.model.named_parameters():
            if getattr(param, "shared", False):  # the last stage's copy of tied embeddings
                continue
            key, layer, experts = self._checkpoint_key(name)
            for expert, full in self._gather(name, param, experts):
                if not megatron_pipeline.is_stage_leader():
                    continue
                rule = rules[key]
                layer_id = None if layer is None else layer + offset
                for hf_name, tensor in zip(rule.hf_names(layer_id, expert), mapping.to_hf(rule, full, self.shape)):
                    yield hf_name, tensor.to(dtype).cpu()

    def _checkpoint_key(self, name: str) -> tuple[str, int | None, tuple[int, int] | None]:
        """(checkpoint key, layer, (local expert, experts per rank) or None) of a parameter name."""
        match = _LAYER.fullmatch(name)
        if not match:
            return name, None, None
        layer, rest = int(match.group(1)), match.group(2)
        expert = _EXPERT.fullmatch(rest)
        if expert:
            per_rank = self.shape.num_experts // self.args.expert_model_parallel_size
            return "decoder.layers.mlp.experts.experts." + expert.group(2), layer, (int(expert.group(1)), per_rank)
        return "decoder.layers." + _LOCAL_NAMES.get(rest, rest), layer, None

    def _gather(self, name: str, param: torch.Tensor,
                experts: tuple[int, int] | None) -> Iterator[tuple[int | None, torch.Tensor]]:
        """The full tensor (TP shards joined), once per global expert for expert weights.
        Expert weights are split over the expert-TP group (--expert-tensor-parallel-size), the rest
        over the TP group."""
        data = param.detach()
        if experts is None:
            tp_size, tp_group = self.tp_size, ps.get_tensor_model_parallel_group()
        else:
            tp_size, tp_group = self.etp_size, ps.get_expert_tensor_parallel_group()
        if getattr(param, "tensor_model_parallel", False) and tp_size > 1:
            parts = [torch.empty_like(data) for _ in range(tp_size)]
            dist.all_gather(parts, data.contiguous(), group=tp_group)
            dim = param.partition_dim
            if name.endswith("linear_fc1.weight") and self.model.config.gated_linear_unit:
                # Each rank holds [gate shard; up shard]: join the gates, then the ups.
                halves = [p.chunk(2, dim=0) for p in parts]
                data = torch.cat([torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])])
            else:
                data = torch.cat(parts, dim=dim)
        if experts is not None and self.args.expert_model_parallel_size > 1:
            parts = [torch.empty_like(data) for _ in range(self.args.expert_model_parallel_size)]
            dist.all_gather(parts, data.contiguous(), group=ps.get_expert_model_parallel_group())
            local, per_rank = experts
            for ep_rank, part in enumerate(parts):
                yield ep_rank * per_rank + local, part
            return
        yield (experts[0] if experts else None), data

    # ---------------------------------------------------------------- checkpoints
    def save(self, ckpt_dir: Path, common: dict[str, Any]) -> None:
        megatron_state.save_megatron(ckpt_dir, self.model, self.actor.optimizer,
                                     {**common, "lr_scheduler": self.actor.scheduler.state_dict()})
        if self.critic is not None:
            (ckpt_dir / CRITIC_DIR).mkdir(exist_ok=True)
            megatron_state.save_megatron(ckpt_dir / CRITIC_DIR, self.critic.model, self.critic.optimizer,
                                         {"lr_scheduler": self.critic.scheduler.state_dict()})

    def load(self, ckpt_dir: Path, weights_only: bool) -> dict[str, Any]:
        common = self._load(ckpt_dir, weights_only)
        if weights_only:  # a full load restored the masters with the optimizer
            for trainee in (self.actor, self.critic):
                if trainee is not None:
                    trainee.optimizer.refresh_masters()
        return common

    def _load(self, ckpt_dir: Path, weights_only: bool) -> dict[str, Any]:
        common = megatron_state.load_megatron(ckpt_dir, self.model, None if weights_only else self.actor.optimizer)
        if weights_only:
            if self.critic is not None:  # the critic starts as the initial policy with a zero value head
                backbone = {k: v for k, v in self.model.state_dict().items() if not k.startswith("output_layer")}
                self.critic.model.load_state_dict(backbone, strict=False)
            return {}
        self.actor.scheduler.load_state_dict(common.pop("lr_scheduler"))
        if self.critic is not None:
            critic_common = megatron_state.load_megatron(ckpt_dir / CRITIC_DIR, self.critic.model, self.critic.optimizer)
            self.critic.scheduler.load_state_dict(critic_common["lr_scheduler"])
        return common

    def load_teacher(self, ckpt_dir: Path) -> None:
        megatron_state.load_megatron(ckpt_dir, self.teacher_model, None)
        self.teacher_model.requires_grad_(False)

    def load_reference(self, ckpt_dir: Path) -> None:
        megatron_state.load_megatron(ckpt_dir, self.ref_model, None)
        self.ref_model.requires_grad_(False)


def _is_expert(name: str) -> bool:
    """An expert weight, held by the expert grid (EP x expert-TP): megatron marks these
    allreduce=False only when EP > 1, but with --expert-tensor-parallel-size != TP their
    data-parallel group differs from the dense weights' at EP 1 too."""
    return ".mlp.experts." in name


def _all_reduce_sum(grads: list[torch.Tensor], group) -> None:
    """One coalesced all-reduce of these tensors, in place: of the buffer they tile where they do
    (the main grads), else of a flattened copy."""
    if not grads or dist.get_world_size(group) == 1:
        return
    if (span := main_grads.flat_span(grads)) is not None:
        dist.all_reduce(span, group=group)
        return
    flat = torch._utils._flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=group)
    for g, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
        g.copy_(synced)
