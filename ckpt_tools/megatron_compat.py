"""Lets megatron-core 0.16.1 run without TransformerEngine: on a CPU-only torch (gloo process groups),
and on a GPU where 0.16.1 leaves a TE-only symbol undefined.

megatron-core assumes CUDA in a few places that are reached even on CPU (RNG tracker, rotary
embedding, dist_checkpointing's barriers, TP gathers). `apply()` redirects exactly those to
their CPU equivalents when no GPU is present, and defines what 0.16.1 leaves undefined without
TransformerEngine; it is safe to call repeatedly.
"""

from __future__ import annotations

import importlib
import importlib.util

# Without psutil, dist_checkpointing.save hangs forever (its writer subprocess dies on
# _process_memory() and the parent waits on a queue): fail at import time instead.
import psutil  # noqa: F401
import torch

_applied = False


def apply() -> None:
    """Redirect megatron-core's CUDA-only calls to CPU (none with a GPU) and mend what it leaves
    undefined without TransformerEngine (CPU and GPU alike). Idempotent."""
    global _applied
    if _applied:
        return
    _applied = True
    # 0.16.1 tests `te_general_gemm is not None` in the MoE router without defining it when
    # TransformerEngine is absent (NameError, on a GPU too); None selects the torch path.
    moe_utils = importlib.import_module("megatron.core.transformer.moe.moe_utils")
    if not hasattr(moe_utils, "te_general_gemm"):
        _patch(moe_utils, "te_general_gemm", None)
    # Without TransformerEngine, 0.16.1's MLA module still finds megatron's TE stand-ins (mocks) and
    # calls isinstance() with one (TypeError): tell it TE is absent.
    if importlib.util.find_spec("transformer_engine") is None:
        _patch(importlib.import_module("megatron.core.transformer.multi_latent_attention"), "HAVE_TE", False)
    # megatron's replicated local Linear (MLA's down-projections at TP > 1) keeps no extra state, its
    # parallel linears an empty one: the same checkpoint then loads at every TP size.
    replicated = importlib.import_module("megatron.core.post_training.modelopt.layers").Linear
    _patch(replicated, "get_extra_state", lambda self: None)
    _patch(replicated, "set_extra_state", lambda self, state: None)
    if torch.cuda.is_available():
        return
    cuda = torch.cuda
    # dist_checkpointing preload/finalize and parallel_state synchronize; CPU ops are synchronous.
    _patch(cuda, "synchronize", lambda device=None: None)
    # Used as `device=` for buffers (TP gathers, rotary inv_freq.to(...)): "cpu" is valid there.
    _patch(cuda, "current_device", lambda: "cpu")
    # The RNG tracker forks (even with dropout 0) and seeds "cuda" generators: use the CPU one.
    _patch(cuda, "get_rng_state", lambda device="cuda": torch.get_rng_state())
    _patch(cuda, "manual_seed", lambda seed: torch.manual_seed(seed))
    random = importlib.import_module("megatron.core.tensor_parallel.random")
    _patch(random, "_get_cuda_rng_state", lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state())
    _patch(random, "_set_cuda_rng_state",
           lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state))
    # Pipeline parallelism: tied embeddings move the last stage's copy with .cuda() before their
    # first all-reduce (a CPU-only torch cannot run .cuda() at all, so nothing else changes) ...
    _patch(torch.Tensor, "cuda", lambda self, *args, **kwargs: self)
    # ... and the pipeline schedules count tokens in a tensor they create on "cuda" by name.
    schedules = importlib.import_module("megatron.core.pipeline_parallel.schedules")
    _patch(schedules, "torch", _TorchOnCpu())


def _patch(owner: object, name: str, replacement: object) -> None:
    """owner.name = replacement. Through setattr, as the replacements do not have the originals'
    types on purpose ("cpu" for a device index, the CPU generator for CUDA's)."""
    setattr(owner, name, replacement)


class _TorchOnCpu:
    """torch, but zeros(..., device="cuda") is made on the CPU (for megatron's pipeline schedules)."""

    def __getattr__(self, name: str):
        return getattr(torch, name)

    @staticmethod
    def zeros(*size, device=None, **kwargs) -> torch.Tensor:
        return torch.zeros(*size, device="cpu" if device == "cuda" else device, **kwargs)
