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


# -- top_k, min_p and penalties against transformers' own processors -------------------------


def hf_probs(logits, temperature, top_k, top_p, min_p) -> torch.Tensor:
    """The distribution transformers' generate() samples from, warpers in its order."""
    from transformers.generation.logits_process import (
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    scores = logits[None].clone()
    warpers = [TemperatureLogitsWarper(temperature)]
    warpers += [TopKLogitsWarper(top_k)] if top_k else []
    warpers += [TopPLogitsWarper(top_p)] if top_p < 1 else []
    warpers += [MinPLogitsWarper(min_p)] if min_p else []
    for warper in warpers:
        scores = warper(None, scores)
    return torch.softmax(scores, dim=-1)[0]


def our_probs(logits, temperature, top_k, top_p, min_p) -> torch.Tensor:
    weights, tokens = sampler.candidates(logits, temperature, top_p, top_k, min_p)
    probs = torch.zeros_like(logits)
    probs[tokens if tokens is not None else torch.arange(logits.numel())] = weights
    return probs / probs.sum()


@pytest.mark.parametrize(
    "temperature, top_k, top_p, min_p",
    [
        (0.7, 20, 0.8, 0.0),  # Qwen2.5's generation_config.json
        (1.0, 50, 1.0, 0.0),
        (0.8, 0, 1.0, 0.05),
        (1.3, 0, 0.95, 0.1),
        (0.7, 40, 0.9, 0.2),
        (1.0, 2000, 0.99, 0.0),  # top_k past TOP_CANDIDATES
    ],
)
@pytest.mark.parametrize("spread", [0.5, 3.0])
def test_candidates_are_what_transformers_samples_from(temperature, top_k, top_p, min_p, spread):
    logits = torch.randn(32_000, generator=torch.Generator().manual_seed(5)) * spread
    ours = our_probs(logits, temperature, top_k, top_p, min_p)
    theirs = hf_probs(logits, temperature, top_k, top_p, min_p)
    assert torch.equal(ours > 0, theirs > 0)  # the same candidates
    assert torch.allclose(ours, theirs, atol=1e-6)


def test_top_k_and_min_p_draw_only_their_candidates():
    logits = torch.tensor([5.0, 4.0, 3.0, 0.0, -1.0])
    gen = torch.Generator().manual_seed(0)
    assert {sampler.pick(logits, 1.0, 1.0, gen, top_k=2) for _ in range(300)} == {0, 1}
    # min_p 0.1: p / p_max >= 0.1 keeps logits within ln(10) = 2.3 of the best
    assert {sampler.pick(logits, 1.0, 1.0, gen, min_p=0.1) for _ in range(300)} == {0, 1, 2}
    assert {sampler.pick(logits, 1.0, 1.0, gen, top_k=1) for _ in range(20)} == {0}


def hf_repetition(logits, seen: list[int], penalty: float) -> torch.Tensor:
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    return RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([seen]), logits[None].clone())[0]


def test_penalties_follow_transformers_and_openai():
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(2)) * 3
    prompt, answer = [5, 9, 9, 700], [9, 31, 31, 31, 700, 2]
    penalties = sampler.Penalties(prompt, repetition=1.3, frequency=0.4, presence=0.25)
    for token in answer:
        penalties.add(token)
    ours = logits.clone()
    penalties.apply_(ours)
    expected = hf_repetition(logits, prompt + answer, 1.3)  # prompt and answer tokens
    counts = {t: answer.count(t) for t in answer}  # OpenAI's: the answer's tokens only
    for token, count in counts.items():
        expected[token] -= count * 0.4 + 0.25
    assert torch.allclose(ours, expected)
    untouched = torch.ones(1000, dtype=torch.bool)
    untouched[prompt + answer] = False
    assert torch.equal(ours[untouched], logits[untouched])


def test_no_penalty_means_no_penalties_object():
    from inference.runtime.jobs import Sampling

    assert sampler.Penalties.of([1, 2], Sampling(max_tokens=1)) is None
    assert sampler.Penalties.of([1, 2], Sampling(max_tokens=1, presence_penalty=-0.5))


def test_logprobs_are_the_log_softmax_sorted_and_finite():
    scores = torch.randn(500, generator=torch.Generator().manual_seed(4))
    scores[7] = float("-inf")  # a token a grammar forbids
    chosen, top = sampler.logprobs(scores, 3, 5)
    reference = torch.log_softmax(scores.double(), dim=-1)
    assert chosen == pytest.approx(float(reference[3]), abs=1e-5)
    assert [i for i, _ in top] == reference.topk(5).indices.tolist()
    assert [v for _, v in top] == sorted((v for _, v in top), reverse=True)
    assert sampler.logprobs(scores, 7, 0) == (sampler.NO_CHANCE, [])
    _, everything = sampler.logprobs(scores, 3, 500)
    assert len(everything) == 499 and 7 not in [i for i, _ in everything]  # never listed
