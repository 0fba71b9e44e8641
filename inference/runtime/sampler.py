"""The next token from a row of logits: greedy, or temperature with nucleus (top_p) sampling.

Why not sort the whole vocabulary for top_p: on Qwen's 151936 tokens a sampled token took
22.3 ms with top_p and 5.5 without, half a decode step (docs/speed.md). The nucleus is
looked for among the TOP_CANDIDATES most likely tokens first, and all are sorted only when it
reaches past them.
The draw is the exponential race torch's multinomial (one sample) also runs, without its
checks over the whole vocabulary; a weight that is NaN, or all zero, is refused here instead.
"""

from __future__ import annotations

import torch

# Below this, logits / temperature overflows float32 and the softmax turns to NaN; such a
# temperature means "greedy" anyway.
MIN_TEMPERATURE = 1e-3
TOP_CANDIDATES = 1024  # a chat model's nucleus is nearly always inside its top 1024


def pick(logits: torch.Tensor, temperature: float, top_p: float, generator=None) -> int:
    """Greedy when temperature is below MIN_TEMPERATURE, else temperature + nucleus sampling.
    The most likely token always stays a candidate, however small top_p is."""
    if temperature < MIN_TEMPERATURE:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p >= 1.0:
        return draw(probs, generator)
    weights, tokens = nucleus(probs, top_p)
    return int(tokens[draw(weights, generator)])


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
