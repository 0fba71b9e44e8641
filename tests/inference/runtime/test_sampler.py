"""The sampler: the nucleus found among the top candidates is the one a full sort finds, and
draws follow the weights."""

from __future__ import annotations

import pytest
import torch

from inference.runtime import sampler


def reference_nucleus(probs: torch.Tensor, top_p: float) -> dict[int, float]:
    """Token -> weight, by sorting the whole vocabulary (the sampler before the fast path)."""
    ordered, tokens = torch.sort(probs, descending=True)
    keep = torch.cumsum(ordered, dim=-1) - ordered < top_p
    keep[0] = True
    return {int(t): float(p) for t, p, k in zip(tokens, ordered, keep, strict=True) if k}


def kept(weights: torch.Tensor, tokens: torch.Tensor) -> dict[int, float]:
    return {int(t): float(w) for t, w in zip(tokens, weights, strict=True) if w > 0}


@pytest.mark.parametrize("spread", [0.5, 2.0, 8.0], ids=["flat", "chat-like", "peaked"])
@pytest.mark.parametrize("top_p", [0.5, 0.9, 0.99])
def test_the_nucleus_is_the_one_a_full_sort_finds(spread, top_p):
    gen = torch.Generator().manual_seed(3)
    vocab = 50_000  # many times TOP_CANDIDATES: the flat case needs the fallback to a sort
    probs = torch.softmax(torch.randn(vocab, generator=gen) * spread, dim=-1)
    assert kept(*sampler.nucleus(probs, top_p)) == reference_nucleus(probs, top_p)


def test_a_flat_distribution_takes_the_sort():
    probs = torch.full((5000,), 1 / 5000)
    weights, tokens = sampler.nucleus(probs, 0.9)
    assert (weights > 0).sum() > sampler.TOP_CANDIDATES  # found past the top candidates


def test_draws_follow_the_weights():
    gen = torch.Generator().manual_seed(0)
    weights = torch.tensor([0.0, 0.1, 0.6, 0.3, 0.0])
    counts = torch.zeros(5)
    for _ in range(6000):
        counts[sampler.draw(weights, gen)] += 1
    share = counts / counts.sum()
    assert counts[0] == counts[4] == 0  # a zero weight is never drawn
    assert torch.allclose(share, weights, atol=0.03), share


def test_a_seed_gives_the_same_tokens():
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(1))

    def tokens(seed):
        gen = torch.Generator().manual_seed(seed)
        return [sampler.pick(logits, 0.8, 0.95, gen) for _ in range(20)]

    assert tokens(5) == tokens(5)
    assert tokens(5) != tokens(6)


def test_greedy_below_the_minimum_temperature_not_nan():
    logits = torch.tensor([0.0, 5.0, 1.0])
    assert sampler.pick(logits, 1e-300, 1.0) == 1
    assert sampler.pick(logits, sampler.MIN_TEMPERATURE / 2, 0.1) == 1


def test_sampling_respects_top_p():
    logits = torch.tensor([10.0, 9.9, -50.0, -50.0])
    assert {sampler.pick(logits, 1.0, 0.5) for _ in range(50)} == {0}


def test_nan_logits_are_refused_not_sampled():
    logits = torch.tensor([1.0, float("nan"), 0.5])
    with pytest.raises(ValueError, match="NaN"):
        sampler.pick(logits, 0.8, 0.9)
    with pytest.raises(ValueError, match="all zero"):
        sampler.draw(torch.zeros(4))
