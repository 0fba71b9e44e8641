"""The token budget (inference/runtime/budget.py): the ask, the cap and the context bound."""

from __future__ import annotations

import pytest

from inference.runtime.budget import answer_budget


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
