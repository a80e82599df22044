"""What the megatron backend keeps in a checkpoint folder, through megatron-core's dist_checkpointing
(torch_dist): the model, the optimizer state (Adam or SGD), every rank's RNG states and rank 0's loop state.

Layout, as Megatron-LM writes it where it has a say:
- model tensors under their sharded keys (the keys ckpt_tools writes: a converted HF checkpoint
  loads as weights);
- `optimizer.state.exp_avg.<param key>`, `optimizer.state.exp_avg_sq.<param key>` (SGD:
  `optimizer.state.momentum_buffer.<param key>`) and, where the model is bf16 (--bf16), the fp32
  master weights `optimizer.state.fp32_param.<param key>` (megatron's name): sharded like the
  parameter, so a bf16 run resumes from its fp32 masters, not from the rounded weights; the step, shared by
  every parameter, and the param groups go to common.pt. With the distributed optimizer each
  parameter's state is written by the data-parallel rank that owns it: the same files, so a
  checkpoint loads with or without it, at any data-parallel size;
- `rng_state`: one object per (pp, tp, dp) rank (python, numpy, torch, CUDA, megatron's tracker);
- `common`: the loop state (rollout id, weight version, data buffer...), in common.pt.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import queue
from pathlib import Path
from typing import Any

import torch
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.dist_checkpointing.optimizer import (
    get_param_id_to_sharded_param_map,
    optim_state_to_sharding_state,
)
from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron.core.dist_checkpointing.validation import StrictHandling
from megatron.core.models.gpt import GPTModel

from ckpt_tools.megatron_model import with_legacy_norm_keys
from ckpt_tools.torch_dist import read_metadata
from trainer.checkpoint import process_rng_state, set_process_rng_state
from trainer.megatron.optimizer import ShardedOptimizer

log = logging.getLogger(__name__)

_ADAM = (torch.optim.Adam, torch.optim.AdamW)
_MASTERS = "fp32_param"  # per-parameter optimizer entry holding the fp32 master weights
_MASTERS_PREFIX = f"optimizer.state.{_MASTERS}"
Optimizer = torch.optim.Optimizer | ShardedOptimizer


def sharded_state(model: GPTModel, optimizer: Optimizer | None, common: dict[str, Any]) -> dict[str, Any]:
    """The state dict to hand to dist_checkpointing.save (every rank; `common` matters on rank 0);
    optimizer None: without the optimizer state (--no-save-optim)."""
    model_state = model.sharded_state_dict()
    return {
        "model": model_state,
        **({"optimizer": _optimizer_state(optimizer, model_state)} if optimizer is not None else {}),
        "rng_state": _rng_object(_rng_states()),
        "common": common,
    }


def save_megatron(ckpt_dir: Path, model: GPTModel, optimizer: Optimizer | None, common: dict[str, Any]) -> None:
    """Write model, optimizer (None: none), RNG and `common` into the existing empty folder
    ckpt_dir. Collective."""
    _in_process_results_queue()
    dist_checkpointing.save(
        sharded_state(model, optimizer, common), str(ckpt_dir),
        # `common` is rank 0's: other ranks may hold something else, which is not a mistake; so are
        # the distributed optimizer's parameter lists (each rank's own).
        preprocess_common_before_consistancy_check=_without_rank_specific,
    )


def holds_optimizer(ckpt_dir: Path) -> bool:
    """Whether the checkpoint has optimizer state (not one saved with --no-save-optim, or converted)."""
    return any(key.startswith("optimizer.") for key in read_metadata(Path(ckpt_dir)).state_dict_metadata)


def load_megatron(ckpt_dir: Path, model: GPTModel, optimizer: Optimizer | None, with_rng: bool | None = None
                  ) -> dict[str, Any]:
    """Restore what save_megatron wrote and return `common` ({} if the checkpoint has none).
    optimizer None: the model's weights only (--ref-load, a checkpoint converted from HF, or one
    saved without its optimizer); given, the optimizer too. with_rng (by default, with the
    optimizer: a full load): the RNG states too, when saved with the same parallel layout.
    Collective."""
    with_rng = optimizer is not None if with_rng is None else with_rng
    model_state = with_legacy_norm_keys(model.sharded_state_dict(), ckpt_dir)
    request: dict[str, Any] = {"model": model_state}
    if optimizer is not None:
        request.update(_optimizer_request(Path(ckpt_dir), optimizer, model_state))
    if with_rng:
        request.update(_rng_request(Path(ckpt_dir)))
    # megatron's "missing" keys are the checkpoint's that nobody asked for; "unexpected", the reverse.
    loaded, in_ckpt_only, in_request_only = dist_checkpointing.load(
        request, str(ckpt_dir), strict=StrictHandling.RETURN_ALL)
    _check_keys(ckpt_dir, in_ckpt_only, in_request_only)
    model.load_state_dict(loaded["model"])
    if optimizer is not None:
        _load_optimizer(optimizer, loaded["optimizer"])
    if "rng_state" in request:
        _set_rng_states(loaded["rng_state"])
    return loaded.get("common", {})


def _optimizer_request(ckpt_dir: Path, optimizer: Optimizer, model_state: dict[str, Any]) -> dict[str, Any]:
    """The optimizer state, which must be there."""
    stored = read_metadata(ckpt_dir).state_dict_metadata
    if not any(key.startswith("optimizer.") for key in stored):
        raise RuntimeError(f"{ckpt_dir} holds no optimizer state (converted from HF, or saved weights only): "
                           "load it as weights only (optimizer=None), as --ref-load does")
    with_masters = any(key.startswith(f"{_MASTERS_PREFIX}.") for key in stored)
    return {"optimizer": _optimizer_state(optimizer, model_state, with_masters)}


def _rng_request(ckpt_dir: Path) -> dict[str, Any]:
    """This rank's RNG states (skipped, with a warning, when saved with another parallel layout)."""
    rng = _rng_object(None)
    if rng.unique_key in read_metadata(ckpt_dir).state_dict_metadata:
        return {"rng_state": rng}
    log.warning("%s has no RNG states for this rank's (pp, tp, dp) position %s in %s (saved with "
                "another parallel layout?): random streams go on from the current seed",
                ckpt_dir, rng.global_offset, rng.global_shape)
    return {}


def _without_rank_specific(state: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in state.items() if k != "common"}
    if "optimizer" in out:
        groups = [{k: v for k, v in g.items() if k != "params"} for g in out["optimizer"].get("param_groups", [])]
        out["optimizer"] = {**out["optimizer"], "param_groups": groups}
    return out


def _in_process_results_queue() -> None:
    """megatron-core gathers its writer processes' results in a process-wide queue, made the first
    time as a spawn-context Manager: a new interpreter that re-imports the main module (about 5 s
    on CPU machines, 13 s seen on a GPU node). A synchronous save puts and gets that queue in this
    process only, so a plain queue.Queue serves and the first save costs what the others do."""
    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


def _check_keys(ckpt_dir: Path, in_ckpt_only: set[str], in_request_only: set[str]) -> None:
    """Strict both ways for the model; a weights-only load skips optimizer and RNG entries."""
    unused = {k for k in in_ckpt_only if not k.startswith(("optimizer.", "rng_state"))}
    problems = [f"{what} {sorted(keys)}" for what, keys in (
        ("the checkpoint lacks", in_request_only), ("the model has no place for", unused)) if keys]
    if problems:
        raise RuntimeError(f"checkpoint {ckpt_dir} does not match the model: {'; '.join(problems)}")


# ---- optimizer ---------------------------------------------------------------------------------

def _parts(optimizer: Optimizer) -> tuple[torch.optim.Optimizer, list[torch.nn.Parameter], bool]:
    """(torch optimizer, the model parameters it updates in its order, whether DP-sharded)."""
    if isinstance(optimizer, ShardedOptimizer):
        return optimizer.optimizer, optimizer.owned, optimizer.distributed
    return optimizer, [p for group in optimizer.param_groups for p in group["params"]], False


def _optimizer_state(optimizer: Optimizer, model_state: dict[str, Any],
                     with_masters: bool | None = None) -> dict[str, Any]:
    """The optimizer's state with each per-parameter tensor as a ShardedTensor shaped like its
    parameter (as megatron's FP32Optimizer does for a torch optimizer); Adam's step is one value
    for all parameters. with_masters (default: where the model's parameters are not fp32): the fp32
    master weights too."""
    torch_optimizer, params, distributed = _parts(optimizer)
    _init_state(torch_optimizer)  # a fresh optimizer has no state to save, or to load into
    state = torch_optimizer.state_dict()
    if with_masters is None:
        with_masters = any(p.dtype != torch.float32 for p in params)
    if with_masters:
        masters = [p for group in torch_optimizer.param_groups for p in group["params"]]
        for index, master in enumerate(masters):  # a new dict: the optimizer's own stays as it is
            state["state"][index] = {**state["state"][index], _MASTERS: master.detach()}
    step = _common_step(torch_optimizer)
    optim_state_to_sharding_state(state, get_param_id_to_sharded_param_map(model_state, params), exclude_keys=("step",))
    if distributed:
        _owner_is_main_replica(state)
    if step is not None:
        state["state"]["common_step"] = step
    return state


def _owner_is_main_replica(state: dict[str, Any]) -> None:
    """Model tensors are written by (expert-)data-parallel rank 0 (the last entry of replica_id);
    a parameter's optimizer state only by the rank that owns it, which holds the only copy."""
    for param_state in state["state"].values():
        for key, sharded in param_state.items():
            rid = sharded.replica_id
            param_state[key] = dataclasses.replace(sharded, replica_id=(*rid[:-1], 0) if isinstance(rid, tuple) else 0)


def _init_state(optimizer: torch.optim.Optimizer) -> None:
    """Give every parameter the state the optimizer would create on its first step (Adam: step 0,
    zero moments; SGD: a zero momentum buffer), which changes nothing in what it computes next."""
    if not isinstance(optimizer, (*_ADAM, torch.optim.SGD)):
        raise TypeError(f"megatron checkpoints hold Adam/AdamW/SGD state; got {type(optimizer).__name__}")
    if optimizer.state:
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state[p]
            if isinstance(optimizer, torch.optim.SGD):
                if group["momentum"]:  # with dampening 0, 0 * momentum + g equals the first step's g
                    if group["dampening"]:
                        raise ValueError("SGD with dampening starts its momentum from the first gradient: not saved")
                    state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                continue
            # fused Adam keeps its step beside the parameter, as torch would create it
            state["step"] = torch.tensor(0.0, dtype=torch.float32, device=p.device if group.get("fused") else None)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if group["amsgrad"]:
                state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def _common_step(optimizer: torch.optim.Optimizer) -> torch.Tensor | None:
    """Adam's step, the same for every parameter; None for SGD (it keeps none)."""
    if not isinstance(optimizer, _ADAM):
        return None
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if not params:
        return torch.tensor(0.0)  # a data-parallel rank that owns no parameter
    without = [i for i, p in enumerate(params) if "step" not in optimizer.state[p]]
    if without:
        raise ValueError(f"optimizer parameters {without} have no state while others do (never given a "
                         "gradient?): the checkpoint keeps one step for all parameters")
    steps = {float(optimizer.state[p]["step"]) for p in params}
    if len(steps) > 1:
        raise ValueError(f"optimizer steps differ between parameters {sorted(steps)}: the checkpoint "
                         "keeps one step for all parameters")
    return optimizer.state[params[0]]["step"].to("cpu", copy=True)


def _load_optimizer(optimizer: Optimizer, loaded: dict[str, Any]) -> None:
    torch_optimizer, _, _ = _parts(optimizer)
    masters = {index: param_state.pop(_MASTERS) for index, param_state in loaded["state"].items()
               if isinstance(param_state, dict) and _MASTERS in param_state}
    if isinstance(optimizer, ShardedOptimizer) and not masters:
        # from the weights just loaded; not otherwise: the load may have filled the masters in place
        optimizer.refresh_masters()
    with torch.no_grad():
        for index, master in enumerate(p for group in torch_optimizer.param_groups for p in group["params"]):
            if index in masters:
                master.copy_(masters[index])
    step = loaded["state"].pop("common_step", None)
    if step is not None:
        for param_state in loaded["state"].values():
            param_state["step"] = copy.deepcopy(step)
    # The param groups come from rank 0's common.pt: keep this rank's own parameter lists.
    for saved, own in zip(loaded["param_groups"], torch_optimizer.state_dict()["param_groups"]):
        saved["params"] = own["params"]
    torch_optimizer.load_state_dict(loaded)


# ---- RNG ---------------------------------------------------------------------------------------

def _rng_states() -> dict[str, Any]:
    return {**process_rng_state(), "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}


def _set_rng_states(states: dict[str, Any]) -> None:
    set_process_rng_state(states)
    tensor_parallel.get_cuda_rng_tracker().set_states(states["tracker"])


def _rng_object(states: dict[str, Any] | None) -> ShardedObject:
    """This rank's RNG states as its own entry of a (pp, tp, dp) grid: each rank draws its own
    random numbers, so each rank's states are kept (replica_id 0 everywhere)."""
    ps = parallel_state
    shape = (ps.get_pipeline_model_parallel_world_size(), ps.get_tensor_model_parallel_world_size(),
             ps.get_data_parallel_world_size(with_context_parallel=True))
    offset = (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank(),
              ps.get_data_parallel_rank(with_context_parallel=True))
    return ShardedObject("rng_state", states, shape, offset, replica_id=0)
