"""The token budget (inference/runtime/budget.py): the ask, the cap and the context bound."""

from __future__ import annotations

import pytest

from inference.runtime.budget import answer_budget
from inference.runtime.jobs import Sampling


@pytest.mark.parametrize(
    ("prompt", "wanted", "context", "cap", "budget"),
    [
        (10, 100, 4096, None, 100),  # the request's own ask
        (10, 100, 4096, 50, 50),  # the server's cap
        (4000, 500, 4096, 1000, 96),  # what the context leaves after the prompt
        (4096, 5, 4096, None, 0),  # nothing left: the stream ends at once with "length"
        (5000, 5, 4096, None, 0),  # never negative
    ],
)
def test_answer_budget(prompt: int, wanted: int, context: int, cap: int | None, budget: int):
    assert answer_budget(prompt, wanted, context, cap=cap) == budget


def test_the_engine_trusts_the_decided_budget(engines):
    """The engine takes `max_tokens` as the budget decided at admission: it sizes the stream
    and the reservation from it, and refuses one that passes the context rather than cut it
    (a second decision)."""
    engine, _plain, prompts = engines
    ids = prompts.encode([{"role": "user", "content": "Hi"}])
    room = engine.context_tokens - len(ids)
    per_token = engine.decoder.bytes_per_token()
    assert engine.cache_bytes(len(ids), room) == (len(ids) + room) * per_token
    budget = answer_budget(len(ids), 10**6, engine.context_tokens)
    stream = engine.open(ids, Sampling(max_tokens=budget))
    assert stream.budget == room and stream.cache.capacity == engine.context_tokens
    engine.close(stream, interrupted=True)
    with pytest.raises(ValueError, match="budget"):
        engine.open(ids, Sampling(max_tokens=room + 1))
