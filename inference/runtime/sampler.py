"""The next token from a row of logits: penalties, then greedy, or temperature with top_k,
nucleus (top_p) and min_p sampling, in the order of transformers' generate() and vLLM. Also
the log-probabilities a request may ask for.

Why not sort the whole vocabulary for top_p: on Qwen's 151936 tokens a sampled token took
22.3 ms with top_p and 5.5 without, half a decode step (docs/speed.md). The nucleus is
looked for among the TOP_CANDIDATES most likely tokens first (or the top_k), and all are
sorted only when it reaches past them; min_p is a threshold on the weights, no sort at all;
penalties touch only the tokens already seen, by index.
The draw is the exponential race torch's multinomial (one sample) also runs, without its
checks over the whole vocabulary; a weight that is NaN, or all zero, is refused here instead.
"""

from __future__ import annotations

import math

import torch

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
        weights = torch.softmax(top, dim=-1)
    else:
        weights = torch.softmax(scaled, dim=-1)
    if top_p < 1.0:
        weights, order = nucleus(weights, top_p)
        tokens = order if tokens is None else tokens[order]
    if min_p > 0.0:  # a ratio to the best: the same on renormalised weights
        weights = weights * (weights >= min_p * weights.max())
    return weights, tokens


def nucleus(probs: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, token ids), most likely first: the probabilities of the smallest set of
    most likely tokens whose mass reaches top_p, and zeros after it."""
    k = min(TOP_CANDIDATES, probs.numel())
    top, tokens = torch.topk(probs, k)
    mass = torch.cumsum(top, dim=-1)
    if k < probs.numel() and float(mass[-1]) < top_p:  # the nucleus is wider: sort them all
        top, tokens = torch.sort(probs, descending=True)
        mass = torch.cumsum(top, dim=-1)
    keep = mass - top < top_p
    keep[0] = True
    return top * keep, tokens


def draw(weights: torch.Tensor, generator=None) -> int:
    """An index, with probability proportional to its weight (weights >= 0, not all 0)."""
    race = torch.empty_like(weights).exponential_(generator=generator)
    race.clamp_(min=torch.finfo(race.dtype).tiny)  # never a zero time: no division by it
    index = int(torch.argmax(weights / race))
    if not weights[index] > 0:  # NaN sorts first and wins the race; all zero: nothing to draw
        raise ValueError("no token to draw: the weights are NaN or all zero")
    return index


def logprobs(scores: torch.Tensor, token: int, alternatives: int) -> tuple[float, list]:
    """The token's log-probability under the softmax of `scores` (NO_CHANCE for -inf), and
    the `alternatives` most likely (id, log-probability), most likely first: fewer where
    fewer can be picked at all (a grammar's mask leaves -inf, and a list of arbitrary
    impossible tokens would tell nothing)."""
    values = torch.log_softmax(scores.float(), dim=-1)
    best = []
    if alternatives > 0:
        top, ids = torch.topk(values, min(alternatives, values.numel()))
        best = [(i, v) for i, v in zip(ids.tolist(), top.tolist(), strict=True) if v > -math.inf]
    chosen = float(values[token])
    return chosen if math.isfinite(chosen) else NO_CHANCE, best


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
