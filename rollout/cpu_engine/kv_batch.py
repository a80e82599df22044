"""One forward pass over many sequences, each with its own KV cache and its own new tokens.

Every sequence keeps its KV cache per layer as [kv_heads, tokens, head_dim]. A step left-pads
all caches to the longest (P) and all new tokens to the longest (N), runs the model once on the
[B, N] batch with a custom [B, 1, N, P+N] mask, and appends each sequence's new keys and values
to its own cache. Sequences can therefore join (a prompt of any length) and leave (finished)
between any two steps, and a step that mixes prompts with decoding still is one forward pass.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

LayerKV = tuple[torch.Tensor, torch.Tensor]  # keys, values: [kv_heads, tokens, head_dim]


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
