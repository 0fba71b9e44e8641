"""The next token from a row of logits: penalties, then greedy, or temperature with top_k,
nucleus (top_p) and min_p sampling, in the order of transformers' generate() and vLLM. Also
the log-probabilities a request may ask for.

Why not sort the whole vocabulary for top_p: on Qwen's 151936 tokens a sampled token took
22.3 ms with top_p and 5.5 without, half a decode step (docs/speed.md). The nucleus is
looked for among the TOP_CANDIDATES most likely tokens first (or the top_k), and all are
sorted only when it reaches past them; min_p is a threshold on the weights, no sort at all;
penalties touch only the tokens already seen, by index.
Every step here has the same bits on every CPU (docs/same-answers.md): torch's softmax, cumsum and
log_softmax change their last bits with the vector width, and a seeded request must get the
same text from every PC of a fleet. The exponentials are inference/quant/exact.py's, the
sums exact in fixed point, and the draw one 53-bit random integer against the exact running
sum of the weights (inverse CDF): a weight that is NaN, or all zero, is refused.
"""

from __future__ import annotations

import math

import torch

from inference.quant import exact

# Below this, logits / temperature overflows float32 and the softmax turns to NaN; such a
# temperature means "greedy" anyway.
MIN_TEMPERATURE = 1e-3
TOP_CANDIDATES = 1024  # a chat model's nucleus is nearly always inside its top 1024
# What OpenAI reports for a token that cannot be picked at all (JSON has no -Infinity).
NO_CHANCE = -9999.0


def pick(
    logits: torch.Tensor,
    temperature: float,
    top_p: float = 1.0,
    generator=None,
    top_k: int = 0,
    min_p: float = 0.0,
) -> int:
    """Greedy when temperature is below MIN_TEMPERATURE, else a draw among `candidates`."""
    if temperature < MIN_TEMPERATURE:
        return int(torch.argmax(logits))
    weights, tokens = candidates(logits, temperature, top_p, top_k, min_p)
    index = draw(weights, generator)
    return index if tokens is None else int(tokens[index])


def candidates(
    logits: torch.Tensor, temperature: float, top_p: float, top_k: int = 0, min_p: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weights, token ids) a draw chooses among: temperature, then the top_k most likely,
    then the nucleus of the (renormalised) rest, then min_p; weights are probabilities,
    zero where cut, not renormalised. Token ids None: the weights are the whole vocabulary
    in id order. The most likely token always stays a candidate, whatever the settings."""
    scaled = logits.float() / temperature
    tokens = None  # None: weights are indexed by token id
    if 0 < top_k < scaled.numel():
        top, tokens = torch.topk(scaled, top_k)
        weights = softmax(top)
    else:
        weights = softmax(scaled)
    if top_p < 1.0:
        weights, order = nucleus(weights, top_p)
        tokens = order if tokens is None else tokens[order]
    if min_p > 0.0:  # a ratio to the best: the same on renormalised weights
        weights = weights * (weights >= min_p * weights.max())
    return weights, tokens


def _near(shifted: torch.Tensor) -> torch.Tensor:
    """Indices of the scores (minus the best) whose weight is at least half the smallest
    step of a draw's fixed point over them all (2^-(bits + 1) of the best): the others'
    would round to 0 in the sum and in the draw, so they are 0 here, never exponentiated."""
    window = (exact.sum_bits(shifted.numel()) + 1) * math.log(2)
    return torch.nonzero(shifted >= -window).squeeze(1)


def softmax(scores: torch.Tensor) -> torch.Tensor:
    """float32 probabilities of float32 scores (1-D), the same bits on every CPU. Only the
    tokens near the best are exponentiated: a few hundred of Qwen's 151936, not all."""
    shifted = scores - scores.max()
    if bool(torch.isnan(shifted[0])):  # a NaN anywhere is the max: draw refuses it
        return shifted
    near = _near(shifted)
    part = exact.exp(shifted[near])
    weights = torch.zeros_like(shifted)
    weights[near] = part / exact.row_sum(part).float()
    return weights


def nucleus(probs: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, token ids), most likely first: the probabilities of the smallest set of
    most likely tokens whose mass reaches top_p, and zeros after it."""
    k = min(TOP_CANDIDATES, probs.numel())
    top, tokens = torch.topk(probs, k)
    mass = exact.cumulative(top)
    if k < probs.numel() and float(mass[-1]) < top_p:  # the nucleus is wider: sort them all
        top, tokens = torch.sort(probs, descending=True)
        mass = exact.cumulative(top)
    keep = mass - top < top_p
    keep[0] = True
    return top * keep, tokens


def draw(weights: torch.Tensor, generator=None) -> int:
    """An index, with probability proportional to its weight (weights >= 0, not all 0): one
    53-bit random integer r picks where r / 2^53 of the exact total falls in the running
    sum. A weight below 2^-(53 - log2 n) of the largest one is never picked."""
    if bool(torch.isnan(weights).any()):
        raise ValueError("no token to draw: the weights are NaN or all zero")
    q, _ = exact.fixed(weights, exact.sum_bits(weights.numel()))
    running = torch.cumsum(q, 0)  # integers below 2^53: exact in any order
    total = int(running[-1])
    if total <= 0:
        raise ValueError("no token to draw: the weights are NaN or all zero")
    r = int(torch.randint(0, 2**53, (1,), generator=generator))
    return int(torch.searchsorted(running, float(r * total >> 53), right=True))


def logprobs(scores: torch.Tensor, token: int, alternatives: int) -> tuple[float, list]:
    """The token's log-probability under the softmax of `scores` (NO_CHANCE for -inf), and
    the `alternatives` most likely (id, log-probability), most likely first: fewer where
    fewer can be picked at all (a grammar's mask leaves -inf, and a list of arbitrary
    impossible tokens would tell nothing)."""
    shifted = scores.float() - scores.float().max()
    near = _near(shifted)
    log_total = float(exact.log(exact.row_sum(exact.exp(shifted[near])))) if len(near) else math.nan
    best = []
    if alternatives > 0:
        top, ids = torch.topk(shifted, min(alternatives, shifted.numel()))
        best = [
            (i, v - log_total)
            for i, v in zip(ids.tolist(), top.tolist(), strict=True)
            if v > -math.inf
        ]
    chosen = float(shifted[token]) - log_total
    return chosen if math.isfinite(chosen) else NO_CHANCE, best


class LogitBias:
    """A request's `logit_bias` (OpenAI): a fixed amount added to chosen tokens' logits,
    first, before the penalties, as llama.cpp and vLLM do. +100 keeps the picks among the
    tokens so raised; -100 all but bans one (an addition, not a mask: OpenAI's word)."""

    def __init__(self, bias: tuple[tuple[int, float], ...]):
        self.ids = torch.tensor([token for token, _ in bias], dtype=torch.long)
        self.amounts = torch.tensor([amount for _, amount in bias], dtype=torch.float32)

    @classmethod
    def of(cls, sampling) -> LogitBias | None:
        return cls(sampling.logit_bias) if sampling.logit_bias else None

    def apply_(self, logits: torch.Tensor) -> None:
        logits[self.ids] += self.amounts  # the logits are float32, as the amounts


class Penalties:
    """One stream's penalties, applied in place to each row of logits before the pick:
    repetition (transformers/vLLM: a seen token's logit divided by it if positive, else
    multiplied; the prompt's tokens and the answer's), then frequency and presence (OpenAI:
    minus count x frequency, minus presence once; the answer's tokens only). The engine
    calls `add` for every picked token in order, so a drafted row sees exactly the history a
    step of its own would have seen."""

    def __init__(self, prompt_ids: list[int], repetition: float, frequency: float, presence):
        self.repetition, self.frequency, self.presence = repetition, frequency, presence
        self._counts: dict[int, int] = {}  # answer token -> times picked
        self._seen = set(prompt_ids) if repetition != 1.0 else set()
        self._seen_ids = torch.tensor(sorted(self._seen), dtype=torch.long)

    @classmethod
    def of(cls, prompt_ids: list[int], sampling) -> Penalties | None:
        """None when the sampling asks for no penalty: nothing to keep up to date."""
        rep, freq, pres = (
            sampling.repetition_penalty,
            sampling.frequency_penalty,
            sampling.presence_penalty,
        )
        if rep == 1.0 and freq == 0.0 and pres == 0.0:
            return None
        return cls(prompt_ids, rep, freq, pres)

    def add(self, token: int) -> None:
        self._counts[token] = self._counts.get(token, 0) + 1
        if self.repetition != 1.0 and token not in self._seen:
            self._seen.add(token)
            self._seen_ids = torch.cat([self._seen_ids, torch.tensor([token])])

    def apply_(self, logits: torch.Tensor) -> None:
        if self.repetition != 1.0 and self._seen_ids.numel():
            ids = self._seen_ids
            seen = logits[ids]
            logits[ids] = torch.where(seen > 0, seen / self.repetition, seen * self.repetition)
        if self._counts and (self.frequency or self.presence):
            ids = torch.tensor(list(self._counts), dtype=torch.long)
            counts = torch.tensor(list(self._counts.values()), dtype=logits.dtype)
            logits[ids] -= counts * self.frequency + self.presence
