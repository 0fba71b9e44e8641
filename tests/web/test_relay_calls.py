"""What the relay makes of an answer that calls tools: its text, its calls, and the logprob
entries of the text before the calls only (OpenAI's `content` logprobs), whole or streamed,
a token per event or several (drafted tokens come together)."""

from __future__ import annotations

import pytest

from inference.runtime.jobs import Delta, Done, TokenLogprob, Usage
from inference.runtime.tools import CallStart, call_text
from web import relay
from web.request_log import RequestLog

PARIS = call_text("get_weather", {"city": "Paris"})
DONE = Done("stop", Usage(10, 20), 0.0, 1.0, 2.0, 3.0)


def entries(text: str, size: int) -> list[TokenLogprob]:
    """`size` characters a token, each entry naming its own text."""
    tokens = [text[i : i + size] for i in range(0, len(text), size)]
    return [TokenLogprob(t, -0.5, tuple(t.encode())) for t in tokens]


def answer_events(text: str, size: int, per_event: int = 1) -> list:
    """The answer as the worker would send it: `per_event` tokens an event."""
    tokens = entries(text, size)
    events = []
    for i in range(0, len(tokens), per_event):
        group = tuple(tokens[i : i + per_event])
        events.append(Delta("".join(t.token for t in group), group))
    return [*events, DONE]


@pytest.mark.parametrize("per_event", [1, 2, 100])
@pytest.mark.parametrize("size", [1, 3, 7])
def test_the_logprobs_of_an_answer_with_calls_are_its_texts_tokens_only(size, per_event):
    events = answer_events(f"Let me look.\n{PARIS}\n{PARIS}", size, per_event)
    answer = relay.collect(relay.read_calls(iter(events)), RequestLog("chat-1", "/chat"))
    assert [c.name for c in answer.calls] == ["get_weather", "get_weather"]
    assert answer.done.finish_reason == "tool_calls"
    assert answer.text == "Let me look."
    # every token that begins within the text, and none after it: the one holding both
    # text and the tag's start goes with the text
    tokens = entries(f"Let me look.\n{PARIS}", size)
    starts = range(0, size * len(tokens), size)
    kept = [e for e, at in zip(tokens, starts, strict=True) if at < len(answer.text)]
    assert answer.logprobs == kept


@pytest.mark.parametrize("size", [1, 3, 7])
def test_streamed_each_entry_rides_with_the_text_it_belongs_to(size):
    """A token the reader holds back (a possible tag's start) goes out with the text it
    lets out later."""
    events = answer_events("Use <tool> here.", size)
    pieces = list(relay.read_calls(iter(events)))
    deltas = [p for p in pieces if isinstance(p, Delta)]
    assert "".join(d.text for d in deltas) == "Use <tool> here."
    assert "".join(e.token for d in deltas for e in d.logprobs) == "Use <tool> here."
    assert not any(isinstance(p, CallStart) for p in pieces)
    assert pieces[-1].finish_reason == "stop"
