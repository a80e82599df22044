"""The stand-in engine's sampler reports SGLang's logprobs: at top_p 1 (the default) every token's
is log_softmax(logits / temperature), the trainer's log-probs to float32 noise, whatever the row;
below 1, the distribution renormalised over the nucleus."""

from __future__ import annotations

import torch

from rollout.cpu_engine.sampling import SamplingParams, sample_next

ROWS = 200
SAME = 1e-6  # float32 log-softmax against itself by another order of operations


def _rows() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(128, generator=g) * 4 for _ in range(ROWS)]


def test_top_p_one_reports_log_softmax_even_where_a_cumulative_sum_passes_one() -> None:
    rows = _rows()
    # The rows where a float32 cumulative sum of the sorted probabilities passes 1.0 before the end:
    # a top-p filter at 1.0 would drop their last tokens and renormalise the others.
    passing = [r for r in rows if ((s := torch.softmax(r, -1).sort(descending=True).values).cumsum(0) - s > 1.0).any()]
    assert len(passing) > ROWS // 10
    g = torch.Generator().manual_seed(1)
    for logits in rows:
        for temperature in (1.0, 0.7):
            draw = sample_next(logits, SamplingParams(temperature=temperature), g, frozenset(), len(logits))
            expected = torch.log_softmax(logits / temperature, -1)
            assert abs(draw.logprob - float(expected[draw.token])) < SAME
            # every token's, the last ones' too (SGLang's top logprobs at top_p 1)
            assert max(abs(value - float(expected[token])) for value, token in draw.top) < SAME


def test_below_one_the_logprobs_are_renormalised_over_the_nucleus() -> None:
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0])
    probs = torch.softmax(logits, -1)
    g = torch.Generator().manual_seed(2)
    draws = [sample_next(logits, SamplingParams(top_p=0.8), g, frozenset(), 0) for _ in range(50)]
    assert {d.token for d in draws} <= {0, 1}  # 0.665 then 0.245: the mass before token 2 passes 0.8
    for d in draws:
        assert abs(d.logprob - float((probs[d.token] / probs[:2].sum()).log())) < SAME
