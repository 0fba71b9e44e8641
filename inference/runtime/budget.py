"""A request's token budget, decided here once: how many answer tokens it may produce.

The request asks (its `max_tokens`, else the server's default), the server caps it
(`--max-tokens-cap`), and the context bounds it: the prompt plus the answer must fit the
model's positions. The relay decides it at admission and puts it in `Sampling.max_tokens`;
from there on it is trusted: the engine sizes the stream and its KV cache
(`SequenceCache.capacity`) from it and refuses one that does not fit the context, and the
worker reserves memory for exactly that. Whatever opens a stream without the relay (the
warm-up, bench/) decides its budget with this same function.

A thinking model's thought is paid from the same budget: `thought_limit` is what a thought
may take so that the answer keeps its room (inference/runtime/accept.py's ThoughtSplit).
"""

from __future__ import annotations


def answer_budget(
    prompt_tokens: int, wanted: int, context_tokens: int, cap: int | None = None
) -> int:
    """The most answer tokens: `wanted`, at most `cap`, at most what the context leaves."""
    if cap is not None:
        wanted = min(wanted, cap)
    return max(0, min(wanted, context_tokens - prompt_tokens))


# The answer keeps at least this many tokens of its budget, or a quarter of a small budget:
# a thought may not eat it all (the server closes the thought before).
ANSWER_ROOM = 64
MARKERS = 2  # tokens the answer's room also pays: `</think>` and the newlines after it


def answer_room(budget: int) -> int:
    return min(ANSWER_ROOM, budget // 4)


def thought_limit(budget: int) -> int:
    """The most thought tokens (markers not counted) a budget allows: the answer keeps its
    room, and the close and the newlines after it fit too."""
    return max(budget - answer_room(budget) - MARKERS, 0)
