"""What the relay makes of an answer that calls tools: its text, its calls, and the logprob
entries of the text outside calls only (OpenAI's `content` logprobs), whole or streamed."""

from __future__ import annotations

import pytest

from inference.runtime.jobs import Delta, Done, TokenLogprob, Usage
from inference.runtime.tools import CallStart, call_text
from web import relay

PARIS = call_text("get_weather", {"city": "Paris"})


class Log:
    def finish(self, status, done) -> None:
        self.status = status


def answer_events(text: str, size: int) -> list:
    """The answer as the worker would send it, `size` characters a token, each token's
    entry naming its own text."""
    tokens = [text[i : i + size] for i in range(0, len(text), size)]
    entries = [TokenLogprob(t, -0.5, tuple(t.encode())) for t in tokens]
    done = Done("stop", Usage(10, len(tokens)), 0.0, 1.0, 2.0, 3.0)
    return [*(Delta(t, (e,)) for t, e in zip(tokens, entries, strict=True)), done]


@pytest.mark.parametrize("size", [1, 3, 7])
def test_the_logprobs_of_an_answer_with_calls_spell_its_text_outside_them(size):
    events = answer_events(f"Let me look.\n{PARIS}\n{PARIS}", size)
    answer = relay.collect(relay.read_calls(iter(events)), Log())
    assert [c.name for c in answer.calls] == ["get_weather", "get_weather"]
    assert answer.done.finish_reason == "tool_calls"
    spelled = "".join(e.token for e in answer.logprobs)
    assert answer.text == "Let me look." and spelled.startswith(answer.text)
    assert "<tool_call>" not in spelled and "Paris" not in spelled


@pytest.mark.parametrize("size", [1, 3, 7])
def test_streamed_each_entry_rides_with_the_text_it_belongs_to(size):
    """A token the reader holds back (a possible tag's start) goes out with the text it
    lets out later; the tokens of a call go nowhere."""
    events = answer_events("Use <tool> here.", size)
    pieces = list(relay.read_calls(iter(events)))
    deltas = [p for p in pieces if isinstance(p, Delta)]
    assert "".join(d.text for d in deltas) == "Use <tool> here."
    assert "".join(e.token for d in deltas for e in d.logprobs) == "Use <tool> here."
    assert not any(isinstance(p, CallStart) for p in pieces)
    assert pieces[-1].finish_reason == "stop"
