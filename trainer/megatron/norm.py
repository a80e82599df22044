"""RMSNorm for megatron-core's local layer spec that also runs under sequence parallelism.

megatron's WrappedTorchNorm (the local spec's norm without TransformerEngine or Apex) refuses
config.sequence_parallel. The norm itself needs nothing special under SP: each TP rank normalises
its own slice of the sequence with the full (replicated) weight. Only the weight's gradient is
partial, so the hidden-state norms mark it `sequence_parallel=True`, as TransformerEngine's norms
do, and the trainer sums such gradients over the TP group (megatron's finalize_model_grads does
the same). q/k norms run after the sequence is gathered, on each rank's own heads: they are not
marked (their gradients are summed over TP as q/k layernorms anyway; MiniMax-M2's, over all heads,
are ckpt_tools.full_qk_norm's).
"""

from __future__ import annotations

import torch
from megatron.core.transformer import TransformerConfig

from ckpt_tools.qwen3_next_norms import ZeroCenteredRMSNorm


def _rms_norm(config: TransformerConfig, hidden_size: int, eps: float,
              autocast_output: bool = False) -> torch.nn.RMSNorm:
    """RMSNorm, or with --apply-layernorm-1p (Qwen3-Next) the zero-centred one (scaling by 1 + weight)."""
    if config.normalization != "RMSNorm":
        raise ValueError(f"normalization {config.normalization!r} is not supported; slurmrl's models use RMSNorm")
    for flag in ("persist_layer_norm", "memory_efficient_layer_norm"):
        if getattr(config, flag):
            raise ValueError(f"{flag} needs TransformerEngine or Apex norms, which are not installed")
    if config.layernorm_zero_centered_gamma:
        kind = _AutocastZeroCenteredRMSNorm if autocast_output else ZeroCenteredRMSNorm
        return kind(hidden_size, eps, config.params_dtype)
    plain = _AutocastRMSNorm if autocast_output else torch.nn.RMSNorm
    return plain(normalized_shape=hidden_size, eps=eps, dtype=config.params_dtype)


def _in_autocast_dtype(out: torch.Tensor) -> torch.Tensor:
    """A norm's output in autocast's dtype when autocast is on. Autocast runs norms in fp32; the
    column-parallel linear after it, under SP, all-gathers its input in the forward and
    reduce-scatters the input's gradient (autocast's dtype) into a buffer of the input's dtype in
    the backward, which NCCL refuses when the two differ (fp32 vs bf16, --bf16 on a GPU)."""
    kind = out.device.type
    return out.to(torch.get_autocast_dtype(kind)) if torch.is_autocast_enabled(kind) else out


class _AutocastRMSNorm(torch.nn.RMSNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _in_autocast_dtype(super().forward(x))


class _AutocastZeroCenteredRMSNorm(ZeroCenteredRMSNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _in_autocast_dtype(super().forward(x))


# megatron's mark on a parameter whose gradient is summed over the sequence-parallel ranks
_SEQUENCE_PARALLEL = "sequence_parallel"


class HiddenStateNorm:
    """The input, pre-MLP and final norms: over a sequence slice per TP rank under SP.
    Takes WrappedTorchNorm's constructor arguments."""

    # A factory class, not a function: megatron's build_module calls a class, returns a function uncalled
    def __new__(  # type: ignore[misc]
            cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_: object) -> torch.nn.RMSNorm:
        norm = _rms_norm(config, hidden_size, eps, autocast_output=True)
        if config.sequence_parallel:
            setattr(norm.weight, _SEQUENCE_PARALLEL, True)
        return norm


class HeadNorm:
    """The q/k norms (over head_dim, on this rank's heads, the whole sequence)."""

    def __new__(  # type: ignore[misc]  # a factory class, as HiddenStateNorm
            cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_: object) -> torch.nn.RMSNorm:
        return _rms_norm(config, hidden_size, eps)
