"""The kernels of a gated delta net layer (Qwen3-Next's linear attention) over packed sequences.

Rows are tokens of several sequences laid end to end; `cu_seqlens` ([0, len0, len0+len1, ...]) says
where each starts, and no state crosses from one sequence to the next: neither the short causal
convolution nor the delta rule's recurrent state.

Two kernels compute the delta rule: flash-linear-attention's Triton one (the `fla` package, CUDA only;
slime's default, `--qwen-gdn-backend fla`) and a torch one (`torch`, any device), the chunked form of
transformers' Qwen3-Next reference, run one sequence at a time. Both take q/k before their L2 norm.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

GdnBackend = Literal["fla", "torch"]
GDN_BACKENDS: tuple[GdnBackend, ...] = ("fla", "torch")
# The chunk length of the torch kernel (fla's too): the sequential scan runs once per chunk
CHUNK = 64


def fla_kernel() -> Callable[..., tuple[Tensor, Tensor | None]]:
    """fla's chunk_gated_delta_rule, or ImportError naming the flag and the fix."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule  # type: ignore[import-not-found]
    except ImportError as e:
        raise ImportError("--qwen-gdn-backend fla: flash-linear-attention is not importable here "
                          f"({e}); pip install flash-linear-attention on the trainer's nodes, or pass "
                          "--qwen-gdn-backend torch (slurmrl's torch kernel, slower)") from e
    return chunk_gated_delta_rule


def check_fla_trains() -> None:
    """fla's kernel runs forward and backward on this rank's GPU, or RuntimeError naming the flag and what fla
    said: fla refuses the backward on Hopper GPUs under Triton < 3.7.1, whose results are wrong there."""
    kernel = fla_kernel()
    if not torch.cuda.is_available():
        raise RuntimeError("--qwen-gdn-backend fla: fla's kernels run on CUDA GPUs only; pass --qwen-gdn-backend "
                           "torch (slurmrl's torch kernel) on CPU workers")
    q, k, v = (torch.randn(1, 8, 2, 16, device="cuda", requires_grad=True) for _ in range(3))
    g, beta = -torch.rand(1, 8, 2, device="cuda"), torch.rand(1, 8, 2, device="cuda")
    try:
        out, _ = kernel(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True,
                        cu_seqlens=torch.tensor([0, 3, 8], device="cuda"))
        out.sum().backward()
    except RuntimeError as e:
        raise RuntimeError(f"--qwen-gdn-backend fla: fla cannot train on this machine ({e}); pass "
                           "--qwen-gdn-backend torch (slurmrl's torch kernel, slower)") from e


def causal_conv1d(x: Tensor, weight: Tensor, cu_seqlens: Tensor) -> Tensor:
    """Depthwise causal convolution of packed rows, then SiLU: x [t, c], weight [c, K] -> [t, c].
    Row i sees rows i-K+1..i of its own sequence only (earlier positions count as zeros)."""
    tokens, kernel = x.shape[0], weight.shape[1]
    starts = torch.repeat_interleave(cu_seqlens[:-1], cu_seqlens.diff())
    position = torch.arange(tokens, device=x.device) - starts.to(x.device)  # within its sequence
    windows = F.pad(x.to(weight.dtype), (0, 0, kernel - 1, 0)).unfold(0, kernel, 1)  # [t, c, K]
    # tap j reads row i - (K-1) + j, inside the sequence only where position >= K-1-j
    inside = position[:, None] >= torch.arange(kernel - 1, -1, -1, device=x.device)[None, :]
    out = (windows * weight[None] * inside[:, None, :].to(weight.dtype)).sum(-1)
    return F.silu(out).to(x.dtype)


def l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    """fla's (and transformers') L2 norm over the last dimension."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _one_sequence(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor) -> Tensor:
    """The chunked gated delta rule over one sequence, fp32: q/k [h, s, dk] (L2-normed), v [h, s, dv],
    g (log decay) and beta [h, s] -> [h, s, dv]. transformers' torch_chunk_gated_delta_rule, unbatched."""
    seq = q.shape[1]
    pad = (CHUNK - seq % CHUNK) % CHUNK
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    heads, chunks = q.shape[0], q.shape[1] // CHUNK
    q = q * q.shape[-1] ** -0.5
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    q, k, k_beta, v_beta = (x.reshape(heads, chunks, CHUNK, x.shape[-1]) for x in (q, k, k_beta, v_beta))
    decay = g.reshape(heads, chunks, CHUNK).cumsum(-1)
    upper = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).triu(1)
    pairwise = (decay[..., :, None] - decay[..., None, :]).masked_fill(upper, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * pairwise  # unit lower triangular, solved once per chunk
    intra = (q @ k.transpose(-1, -2)) * pairwise
    new_values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(system, k_beta * decay.exp()[..., None], upper=False,
                                               unitriangular=True)
    q = q * decay.exp()[..., None]
    k = k * (decay[..., -1:] - decay).exp()[..., None]
    chunk_decay = decay[..., -1].exp()[..., None, None]
    state = q.new_zeros(heads, k.shape[-1], v.shape[-1])
    out = []
    for i in range(chunks):
        v_new = new_values[:, i] - k_cumdecay[:, i] @ state
        out.append(q[:, i] @ state + intra[:, i] @ v_new)
        state = state * chunk_decay[:, i] + k[:, i].transpose(-1, -2) @ v_new
    return torch.cat(out, dim=1)[:, :seq]


def gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, cu_seqlens: Tensor,
                     backend: GdnBackend) -> Tensor:
    """The delta rule over packed rows: q/k [t, h, dk] (before their L2 norm; as many heads as v),
    v [t, h, dv], g and beta [t, h] -> [t, h, dv] in v's dtype."""
    if backend == "fla":
        out, _ = fla_kernel()(q[None], k[None], v[None], g=g[None], beta=beta[None], initial_state=None,
                              output_final_state=False, use_qk_l2norm_in_kernel=True,
                              cu_seqlens=cu_seqlens.to(q.device, torch.long))
        return out[0]
    dtype = v.dtype
    q, k = (l2norm(x.float()) for x in (q, k))
    pieces = [_one_sequence(*(x[a:b].transpose(0, 1).float() for x in (q, k, v, g, beta))).transpose(0, 1)
              for a, b in itertools.pairwise(cu_seqlens.tolist())]
    return torch.cat(pieces).to(dtype)
