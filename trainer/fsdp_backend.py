"""The `fsdp` training backend: a Hugging Face causal LM sharded with PyTorch FSDP2.

Weights load straight from an HF folder (every rank reads it, then fully_shard keeps one shard
per rank: one FSDP unit per decoder layer plus the root). FSDP2 runs on CPU over gloo in the
torch this project pins (2.13), so CPU uses the same code path as GPU; only the dtype differs
(fp32 on CPU; bf16 compute with fp32 master weights and fp32 gradient reduction on GPU).

Micro-batches (trainer.batch.schedule) pack their samples into one sequence; a packed row restarts its
position ids at each sample and carries a block-diagonal causal mask (or, with flash attention,
lets HF derive the varlen boundaries from the position ids), so no sample attends to another.

FSDP runs a collective in every layer's forward and backward, so every rank runs the same
number of forward (and backward) passes: a rank with fewer packs pads with one-token dummies.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import transformers
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from transformers.core_model_loading import revert_weight_conversion

from trainer.backend import OPTIMIZER_SAVED, Backend, PackLoss, steps_on
from trainer.batch import Batching, Pack, TrainSample, rank_packs, response_slices
from trainer.checkpoint import process_rng_state, set_process_rng_state
from trainer.config import TrainerConfig
from trainer.loop import seed_everything
from trainer.lr_schedule import lr_lambda
from trainer.numerics import attention_kernels, check_attention_backend
from trainer.offload import Offloadable
from trainer.token_stats import chunked_log_probs_and_entropy

Result = tuple[Tensor, Tensor | None]  # per-token log-probs [R], entropies [R] or None
_LAYER_PREFIX = re.compile(r"^(.*\.layers\.\d+)\.")
log = logging.getLogger(__name__)


class FSDPBackend(Backend):
    def __init__(self, hf_checkpoint: str | Path, lr: float = 1e-6, weight_decay: float = 0.0,
                 adam_betas: tuple[float, float] = (0.9, 0.98), adam_eps: float = 1e-8,
                 clip_grad: float = 1.0, batching: Batching | None = None,
                 log_probs_batching: Batching | None = None, seed: int = 1234,
                 dtype: torch.dtype = torch.bfloat16, ref_checkpoint: str | Path | None = None,
                 lr_schedule: Callable[[int], float] | None = None,
                 attn_implementation: str | None = None, attention_backend: str = "auto",
                 save_optimizer: bool = True, check_nan: bool = True, log_probs_chunk_size: int = -1) -> None:
        """torch.distributed must already be initialised (gloo on CPU, nccl on GPU).
        dtype: the compute dtype on GPU (master weights and gradient reduction stay fp32); CPU
        always computes in fp32. lr_schedule: the LR factor of each optimizer step (constant 1
        when None). attn_implementation: HF's (sdpa, eager, flash_attention_2...), HF's default
        when None. check_nan: False skips the step of a NaN/inf gradient norm instead of raising
        (--no-check-for-nan-in-loss-and-grad). log_probs_chunk_size: response tokens per log-prob chunk
        (<= 0: a sample's at once)."""
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.dp_rank, self.dp_size = self.rank, self.world_size
        self.save_optimizer = save_optimizer
        self.cpu_group = dist.new_group(backend="gloo")
        self.device = _device()
        self.dtype = dtype if self.device.type == "cuda" else torch.float32
        check_attention_backend(attention_backend, self.device, "fsdp")
        self.attention_backend = attention_backend
        self.clip_grad = clip_grad
        self.check_nan = check_nan
        self.chunk_size = log_probs_chunk_size
        self.batching = batching if batching is not None else Batching()
        self.log_probs_batching = log_probs_batching or self.batching
        seed_everything(seed)
        self.hf_dtype = _checkpoint_dtype(hf_checkpoint)
        mesh = init_device_mesh(self.device.type, (self.world_size,))
        self.model = self._load(hf_checkpoint, mesh, attn_implementation, trainable=True)
        self.ref_model = (self._load(ref_checkpoint, mesh, attn_implementation, trainable=False)
                          if ref_checkpoint is not None else None)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, betas=adam_betas, eps=adam_eps,
                                           weight_decay=weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_schedule or (lambda step: 1.0))
        self.flash = self.model.config._attn_implementation.startswith("flash_attention")

    @classmethod
    def from_config(cls, config: TrainerConfig) -> FSDPBackend:
        """From the trainer's configuration. The reference model (KL) is --hf-checkpoint itself."""
        model, opt, batching = config.model, config.optimizer, config.batching
        return cls(model.hf_checkpoint, lr=opt.lr, weight_decay=opt.weight_decay,
                   adam_betas=(opt.adam_beta1, opt.adam_beta2), adam_eps=opt.adam_eps,
                   clip_grad=opt.clip_grad, batching=Batching.of(batching),
                   log_probs_batching=Batching.of(batching, for_log_probs=True), seed=model.seed,
                   dtype=torch.bfloat16 if model.bf16 else torch.float32,
                   ref_checkpoint=model.hf_checkpoint if config.loss.ref_model_needed else None,
                   lr_schedule=lr_lambda(opt), attention_backend=model.attention_kernels,
                   attn_implementation="eager" if model.attention_backend == "local" else "sdpa",
                   save_optimizer=not config.checkpoint.no_save_optim,
                   check_nan=opt.check_for_nan_in_loss_and_grad, log_probs_chunk_size=model.log_probs_chunk_size)

    def _load(self, path: str | Path, mesh: DeviceMesh, attn_implementation: str | None,
              trainable: bool) -> transformers.PreTrainedModel:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, attn_implementation=attn_implementation)
        # No dropout ever: train_step's log-probs must equal log_probs()'s for the same weights.
        model.eval()
        model.requires_grad_(trainable)
        # Compute in self.dtype, reduce gradients in fp32 (a no-op policy when both are fp32).
        mp = MixedPrecisionPolicy(param_dtype=self.dtype, reduce_dtype=torch.float32)
        for layer in model.get_decoder().layers:
            fully_shard(layer, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        # FSDP averages gradients over ranks; the losses are pre-scaled to be summed. A plain
        # SUM collective: a divide factor alone asks for PREMUL_SUM, which gloo lacks.
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)
        return model

    # ---- forward ------------------------------------------------------------------------------

    def _pack_logits(self, model: nn.Module, pack: Pack) -> Tensor:
        """Logits [T, V] of one packed row, each sample seeing only itself."""
        tokens = pack.tokens.to(self.device)[None]
        positions = pack.position_ids.to(self.device)[None]
        # Flash attention reads sample boundaries from the restarting position ids; eager and
        # sdpa take the explicit mask (HF passes a 4-D mask through unchanged).
        mask = None if self.flash else block_causal_mask(pack.cu_seqlens, self.dtype, self.device)
        with attention_kernels(self.attention_backend):
            return model(input_ids=tokens, position_ids=positions, attention_mask=mask, use_cache=False).logits[0]

    def _padded_packs(self, samples: list[TrainSample], ids: list[int], batching: Batching) -> list[Pack]:
        """This rank's micro-batches, padded with dummies to the largest count of any rank (ranks
        differ only when there are fewer micro-batches than ranks, or they do not divide evenly)."""
        packs = rank_packs(samples, ids, self.dp_size, self.dp_rank, batching)
        count = torch.tensor([len(packs)])
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=self.cpu_group)
        return packs + [_dummy_pack() for _ in range(int(count) - len(packs))]

    def log_probs(self, samples: list[TrainSample], ids: list[int], model: str = "actor",
                  with_entropy: bool = False) -> dict[int, Result]:
        net = self._model(model)
        mine: dict[int, Result] = {}
        with torch.no_grad():
            for pack in self._padded_packs(samples, ids, self.log_probs_batching):
                logits = self._pack_logits(net, pack)
                logps, ents = response_log_probs(logits, pack.tokens.to(self.device),
                                                 response_slices(pack, samples), with_entropy, self.chunk_size)
                for k, i in enumerate(pack.sample_ids):
                    mine[i] = (logps[k].cpu(), ents[k].cpu() if ents is not None else None)
        gathered: list[dict[int, Result]] = [{} for _ in range(self.world_size)]
        dist.all_gather_object(gathered, mine, group=self.cpu_group)
        return {i: result for part in gathered for i, result in part.items()}

    def offloadable(self) -> Offloadable:
        models: list[nn.Module] = [m for m in (self.model, self.ref_model) if m is not None]
        return Offloadable(models, [self.optimizer], self.device)

    def _model(self, name: str) -> nn.Module:
        if name == "actor":
            return self.model
        if name == "ref" and self.ref_model is not None:
            return self.ref_model
        raise ValueError(f"no model {name!r}: 'actor', or 'ref' when ref_checkpoint was given")

    # ---- training -----------------------------------------------------------------------------

    def train_step(self, samples: list[TrainSample], ids: list[int], loss: PackLoss,
                   need_entropy: bool, role: str = "actor", rollout_id: int = 0, step_id: int = 0) -> dict[str, float]:
        if role != "actor":
            raise NotImplementedError("the fsdp backend has no critic: --advantage-estimator ppo needs megatron")
        sums: dict[str, Tensor] = {}
        for pack in self._padded_packs(samples, ids, self.batching):
            logits = self._pack_logits(self.model, pack)
            if not pack.sample_ids:  # dummy: a zero loss still runs every layer's gradient reduce
                (logits.sum() * 0).backward()
                continue
            logps, ents = response_log_probs(logits, pack.tokens.to(self.device),
                                             response_slices(pack, samples), need_entropy, self.chunk_size)
            value, metrics = loss(pack, logps, ents)
            value.backward()
            for key, metric in metrics.items():  # tensors: no host sync per micro-batch
                sums[key] = sums.get(key, 0.0) + metric.detach()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip_grad)
        lr = float(self.scheduler.get_last_lr()[0])
        if steps_on(float(_full(grad_norm)), role, self.check_nan):
            self.optimizer.step()
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        totals = self._sum_over_ranks(sums)
        totals.update(grad_norm=float(_full(grad_norm)), lr=lr)
        return totals

    def _sum_over_ranks(self, sums: dict[str, Tensor]) -> dict[str, float]:
        # Objects, not a tensor all-reduce: a rank without samples has no metric keys at all.
        gathered: list[dict[str, float]] = [{} for _ in range(self.world_size)]
        dist.all_gather_object(gathered, {key: float(value) for key, value in sums.items()}, group=self.cpu_group)
        totals: dict[str, float] = {}
        for part in gathered:
            for key, value in part.items():
                totals[key] = totals.get(key, 0.0) + value
        return totals

    # ---- weights and checkpoints --------------------------------------------------------------

    def hf_weights(self) -> Iterator[tuple[str, Tensor]]:
        """Streams one decoder layer at a time, so rank 0 never holds the whole model."""
        chunk: dict[str, Tensor] = {}
        chunk_key = None
        for name, tensor in _untied_state(self.model):
            key = _chunk_key(name)
            if chunk and key != chunk_key:
                yield from self._hf_chunk(chunk)
                chunk = {}
            chunk_key = key
            full = _full(tensor.detach())  # collective: every rank gathers
            if self.rank == 0:  # a copy: on one rank `full` is the live parameter itself. On its device:
                chunk[name] = full.to(dtype=self.hf_dtype, copy=True)  # NCCL publishing sends it from there
        if chunk:
            yield from self._hf_chunk(chunk)

    def _hf_chunk(self, chunk: dict[str, Tensor]) -> Iterator[tuple[str, Tensor]]:
        # transformers may load checkpoint tensors into fused ones (e.g. MoE experts); undo that.
        yield from revert_weight_conversion(self.model, chunk).items()

    def save(self, ckpt_dir: Path, common: dict[str, Any]) -> None:
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        state = {"model": model_state, **({"optim": optim_state} if self.save_optimizer else {})}
        dcp.save(state, checkpoint_id=ckpt_dir)
        torch.save(process_rng_state(), Path(ckpt_dir) / f"rng_{self.rank}.pt")
        if self.rank == 0:
            torch.save({**common, OPTIMIZER_SAVED: self.save_optimizer, "lr_scheduler": self.scheduler.state_dict()},
                       Path(ckpt_dir) / "common.pt")
        dist.barrier(group=self.cpu_group)

    def load(self, ckpt_dir: Path, weights_only: bool) -> dict[str, Any]:
        ckpt_dir = Path(ckpt_dir)
        # The loop state is the job's own file, written by save(): trusted, any picklable value.
        common = {} if weights_only else torch.load(ckpt_dir / "common.pt", weights_only=False)
        if weights_only or not common.pop(OPTIMIZER_SAVED, True):
            weights = {"model": get_model_state_dict(self.model)}
            dcp.load(weights, checkpoint_id=ckpt_dir)
            set_model_state_dict(self.model, weights["model"])
            if weights_only:
                return {}
            log.warning("%s was saved with --no-save-optim: the optimizer starts afresh", ckpt_dir)
        else:
            model_state, optim_state = get_state_dict(self.model, self.optimizer)
            state: dict[str, Any] = {"model": model_state, "optim": optim_state}
            dcp.load(state, checkpoint_id=ckpt_dir)
            set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                           optim_state_dict=state["optim"])
        set_process_rng_state(torch.load(ckpt_dir / f"rng_{self.rank}.pt", weights_only=False))
        self.scheduler.load_state_dict(common.pop("lr_scheduler"))
        return common


# ---- helpers ----------------------------------------------------------------------------------


def block_causal_mask(cu_seqlens: Tensor, dtype: torch.dtype, device: torch.device) -> Tensor:
    """Additive mask [1, 1, T, T]: 0 where query q may see key k (same sample, k <= q), the
    dtype's minimum elsewhere. Float, not bool: eager attention adds the mask to the scores."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    sample = torch.repeat_interleave(torch.arange(lengths.numel()), lengths).to(device)
    pos = torch.arange(sample.numel(), device=device)
    allowed = (sample[:, None] == sample[None, :]) & (pos[None, :] <= pos[:, None])
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


def response_log_probs(logits: Tensor, tokens: Tensor, slices: list[slice], with_entropy: bool,
                       chunk_size: int = -1) -> tuple[list[Tensor], list[Tensor] | None]:
    """Per sample: log-prob of each response token (fp32, from the logits one position before it)
    and, when asked, the entropy of that distribution; chunk_size rows at a time (token_stats)."""
    logps, ents = [], []
    for sl in slices:
        logp, ent = chunked_log_probs_and_entropy(logits[sl], tokens[sl.start + 1:sl.stop + 1],
                                                  with_entropy=with_entropy, chunk_size=chunk_size)
        logps.append(logp)
        if ent is not None:
            ents.append(ent)
    return logps, ents if with_entropy else None


def _dummy_pack() -> Pack:
    return Pack(sample_ids=[], tokens=torch.zeros(1, dtype=torch.int64),
                cu_seqlens=torch.tensor([0, 1], dtype=torch.int32))


def _device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _checkpoint_dtype(path: str | Path) -> torch.dtype:
    """The dtype the HF folder stores its weights in (fp32 when the config does not say)."""
    dtype = getattr(transformers.AutoConfig.from_pretrained(path), "dtype", None) or torch.float32
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


def _full(tensor: Tensor) -> Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _untied_state(model: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """The state dict without tied aliases: a tied tensor keeps its first name (e.g. the input
    embedding, not lm_head), as HF's save_pretrained writes it."""
    seen: set[int] = set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            yield name, tensor


def _chunk_key(name: str) -> str:
    """'model.layers.3' for a decoder layer's tensors, '' for the others."""
    match = _LAYER_PREFIX.match(name)
    return match.group(1) if match else ""
