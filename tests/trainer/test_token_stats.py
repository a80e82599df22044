"""--log-probs-chunk-size (trainer.token_stats.chunked_log_probs_and_entropy): log-probs, entropies
and their gradients are those of one call, and what the backward pass keeps of the fp32 [tokens,
vocab] intermediates shrinks to one chunk's (the autograd graph's saved tensors, counted)."""

from __future__ import annotations

import pytest
import torch

from trainer.token_stats import chunked_log_probs_and_entropy

TOKENS, VOCAB = 40, 512


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(TOKENS, VOCAB, generator=g) * 3, torch.randint(0, VOCAB, (TOKENS,), generator=g)


def _run(chunk_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """log-probs, entropies, d(loss)/d(logits), and the bytes the autograd graph saved for the backward pass."""
    logits, targets = _inputs()
    logits.requires_grad_(True)
    saved = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        # a view of the logits themselves (a chunk's input) is no copy
        shared = t.untyped_storage().data_ptr() == logits.untyped_storage().data_ptr()
        saved.append(0 if shared else t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logp, ent = chunked_log_probs_and_entropy(logits, targets, with_entropy=True, chunk_size=chunk_size)
        assert ent is not None
        (logp.sum() + 0.1 * ent.sum()).backward()
    assert logits.grad is not None
    return logp.detach(), ent.detach(), logits.grad, sum(saved)


@pytest.mark.parametrize("chunk_size", [1, 7, TOKENS - 1])
def test_chunks_give_one_calls_numbers_and_gradients(chunk_size: int) -> None:
    whole, chunked = _run(-1), _run(chunk_size)
    for a, b in zip(whole[:3], chunked[:3]):
        assert torch.allclose(a, b, rtol=0, atol=1e-6), (a - b).abs().max()


def test_the_backward_pass_keeps_one_chunk_of_fp32_logits() -> None:
    full_rows = TOKENS * VOCAB * 4  # one fp32 [tokens, vocab] copy
    whole, chunked = _run(-1)[3], _run(4)[3]
    assert whole >= 2 * full_rows, whole  # the plain graph keeps several
    assert chunked < full_rows / 20, chunked  # a recomputed chunk keeps only its inputs' views


def test_without_gradients_the_chunks_are_plain_calls() -> None:
    logits, targets = _inputs()
    with torch.no_grad():
        logp, ent = chunked_log_probs_and_entropy(logits, targets, chunk_size=8)
    assert ent is None and logp.shape == (TOKENS,) and not logp.requires_grad
