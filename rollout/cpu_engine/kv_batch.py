"""One forward pass over many sequences, each with its own KV cache and its own new tokens.

Every sequence keeps its KV cache per layer as [kv_heads, tokens, head_dim]. A step left-pads
all caches to the longest (P) and all new tokens to the longest (N), runs the model once on the
[B, N] batch with a custom [B, 1, N, P+N] mask, and appends each sequence's new keys and values
to its own cache. Sequences can therefore join (a prompt of any length) and leave (finished)
between any two steps, and a step that mixes prompts with decoding still is one forward pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
from transformers import Cache, DynamicCache

LayerKV = tuple[torch.Tensor, torch.Tensor]  # keys, values: [kv_heads, tokens, head_dim]


@dataclass
class RecurrentCache:
    """A hybrid model's (Qwen3-Next's, Qwen3.5's) own transformers cache for one sequence: its gated delta net
    layers keep a convolution and a recurrent state, not keys and values per token, which cannot be padded into a
    batch."""

    cache: Cache
    length: int


SequenceCache = list[LayerKV] | RecurrentCache


def cached_length(cache: SequenceCache | None) -> int:
    if cache is None:
        return 0
    return cache.length if isinstance(cache, RecurrentCache) else cache[0][0].shape[1]


def has_recurrent_layers(config: object) -> bool:
    return "linear_attention" in (getattr(config, "layer_types", None) or [])


def recurrent_step(model: torch.nn.Module, new_tokens: list[list[int]],
                   pasts: list[RecurrentCache | None]) -> tuple[torch.Tensor, list[RecurrentCache]]:
    """forward_step for a hybrid model: each sequence alone, through its own transformers cache."""
    device = next(model.parameters()).device
    logits, grown = [], []
    for tokens, past in zip(new_tokens, pasts):
        start = 0 if past is None else past.length
        positions = torch.arange(start, start + len(tokens), device=device)[None]
        with torch.no_grad():
            out = model(input_ids=torch.tensor([tokens], device=device), position_ids=positions,
                        past_key_values=None if past is None else past.cache, use_cache=True, logits_to_keep=1)
        logits.append(out.logits[:, -1, :].float().cpu())
        grown.append(RecurrentCache(out.past_key_values, start + len(tokens)))
    return torch.cat(logits), grown


def step(model: torch.nn.Module, new_tokens: list[list[int]], pasts: list[SequenceCache | None],
         alone: bool) -> tuple[torch.Tensor, list[SequenceCache]]:
    """Next-token logits and grown caches. A batched pass pads every sequence to the batch's shape, which moves
    its logits in the last bits with the company it keeps (about 1e-6 on the tiny model); `alone` (SGLang's
    --enable-deterministic-inference), and always for a hybrid model, each sequence runs by itself."""
    if has_recurrent_layers(getattr(model, "config", None)):
        logits, grown = recurrent_step(model, new_tokens, cast(list[RecurrentCache | None], pasts))
        return logits, list(grown)
    kv = cast(list[list[LayerKV] | None], pasts)
    if not alone:
        logits, batched = forward_step(model, new_tokens, kv)
        return logits, list(batched)
    each = [forward_step(model, [tokens], [past]) for tokens, past in zip(new_tokens, kv)]
    return torch.cat([logits for logits, _ in each]), [grown[0] for _, grown in each]


def forward_step(model: torch.nn.Module, new_tokens: list[list[int]],
                 pasts: list[list[LayerKV] | None]) -> tuple[torch.Tensor, list[list[LayerKV]]]:
    """Logits of the last new token of each sequence ([B, vocab], float32, on the CPU where sampling
    runs) and the grown caches (on the model's device)."""
    batch = len(new_tokens)
    past_lens = [0 if past is None else past[0][0].shape[1] for past in pasts]
    new_lens = [len(tokens) for tokens in new_tokens]
    P, N = max(past_lens), max(new_lens)
    input_ids = torch.zeros(batch, N, dtype=torch.long)
    positions = torch.zeros(batch, N, dtype=torch.long)
    allowed = torch.zeros(batch, N, P + N, dtype=torch.bool)
    causal = torch.ones(N, N, dtype=torch.bool).tril()
    for b, (tokens, c, n) in enumerate(zip(new_tokens, past_lens, new_lens)):
        input_ids[b, N - n:] = torch.tensor(tokens)
        positions[b, N - n:] = torch.arange(c, c + n)
        allowed[b, N - n:, P - c:P] = True  # the sequence's own cached tokens
        allowed[b, N - n:, P + N - n:] = causal[N - n:, N - n:]  # its new tokens, causally
        # Padding queries attend to themselves only: a fully masked row would give NaN.
        pad = torch.arange(N - n)
        allowed[b, pad, P + pad] = True
    dtype, device = next(model.parameters()).dtype, next(model.parameters()).device
    mask = torch.zeros(batch, 1, N, P + N, dtype=dtype).masked_fill(~allowed[:, None], torch.finfo(dtype).min)
    input_ids, positions, mask = input_ids.to(device), positions.to(device), mask.to(device)
    # Full-attention layers only (no config: a sliding-window layer would trim the padded past).
    cache = DynamicCache(ddp_cache_data=_padded_past(pasts, past_lens, P) if P else None)
    with torch.no_grad():
        out = model(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                    past_key_values=cache, use_cache=True, logits_to_keep=1)
    grown = []
    for b, (past, n) in enumerate(zip(pasts, new_lens)):
        layers = []
        for layer_idx, layer in enumerate(cache.layers):
            keys, values = _layer_kv(layer)
            new_k = keys[b, :, P + N - n:]
            new_v = values[b, :, P + N - n:]
            if past is None:
                layers.append((new_k.clone(), new_v.clone()))
            else:
                layers.append((torch.cat([past[layer_idx][0], new_k], dim=1),
                               torch.cat([past[layer_idx][1], new_v], dim=1)))
        grown.append(layers)
    return out.logits[:, -1, :].float().cpu(), grown


def _layer_kv(layer: object) -> LayerKV:
    """A cache layer's keys and values [B, kv_heads, tokens, head_dim]: a plain decoder's every
    layer is attention, filled by the forward that just ran."""
    keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
    if not isinstance(keys, torch.Tensor) or not isinstance(values, torch.Tensor):
        raise TypeError(f"cache layer {type(layer).__name__} holds no attention keys and values")
    return keys, values


def _padded_past(pasts: list[list[LayerKV] | None], past_lens: list[int], P: int) -> list[LayerKV]:
    template = next(past for past in pasts if past is not None)
    layers = []
    for layer_idx, (k0, v0) in enumerate(template):
        keys = k0.new_zeros(len(pasts), k0.shape[0], P, k0.shape[2])
        values = v0.new_zeros(len(pasts), v0.shape[0], P, v0.shape[2])
        for b, (past, c) in enumerate(zip(pasts, past_lens)):
            if c and past is not None:  # (c > 0: it has a past)
                keys[b, :, P - c:] = past[layer_idx][0]
                values[b, :, P - c:] = past[layer_idx][1]
        layers.append((keys, values))
    return layers
