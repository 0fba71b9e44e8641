"""The tool-call format without a model: reading calls out of answer text (whole and piece
by piece alike), the plain-text rendering for templates without tools, the grammar text."""

from __future__ import annotations

import json

import pytest

from inference.runtime import tools
from inference.runtime.jobs import Delta
from inference.runtime.tools import (
    CallArguments,
    CallEnd,
    CallReader,
    CallStart,
    Function,
    ToolUse,
    call_text,
    read_all,
)
from tests.support import schemas

WEATHER, TIME = Function(**schemas.WEATHER), Function(**schemas.TIME)
PARIS = call_text("get_weather", {"city": "Paris"})
NOON = call_text("get_time", {"zone": "UTC"})


def summary(pieces) -> list:
    """Pieces with the random call ids left out, arguments joined per call."""
    out: list = []
    for p in pieces:
        if isinstance(p, Delta):
            if out and out[-1][0] == "text":
                out[-1] = ("text", out[-1][1] + p.text)
            else:
                out.append(("text", p.text))
        elif isinstance(p, CallStart):
            out.append(["call", p.index, p.name, ""])
        elif isinstance(p, CallArguments):
            assert out[-1][0] == "call" and out[-1][1] == p.index
            out[-1][3] += p.text
        else:
            out.append(("end", p.index))
    return [tuple(x) for x in out]


def piecewise(text: str, size: int) -> list:
    reader = CallReader()
    pieces = []
    for i in range(0, len(text), size):
        pieces += reader.feed(text[i : i + size])
    return pieces + reader.finish()


ANSWERS = {
    "text": ("The capital is Tokyo.\n", [("text", "The capital is Tokyo.\n")]),
    "a tag's start at the end": ("Use <tool", [("text", "Use <tool")]),
    "one call": (PARIS, [("call", 0, "get_weather", '{"city": "Paris"}'), ("end", 0)]),
    "two calls": (
        f"{PARIS}\n{NOON}",
        [
            ("call", 0, "get_weather", '{"city": "Paris"}'),
            ("end", 0),
            ("call", 1, "get_time", '{"zone": "UTC"}'),
            ("end", 1),
        ],
    ),
    "text, then a call": (
        f"Let me look.\n{PARIS}",
        [("text", "Let me look."), ("call", 0, "get_weather", '{"city": "Paris"}'), ("end", 0)],
    ),
    "braces and newlines in strings": (
        call_text("get_weather", {"city": "a}\n</tool_call>b"}),
        [("call", 0, "get_weather", '{"city": "a}\\n</tool_call>b"}'), ("end", 0)],
    ),
    "cut short": (PARIS[: PARIS.index("ris")], [("call", 0, "get_weather", '{"city": "Pa')]),
}


@pytest.mark.parametrize("name", ANSWERS)
def test_calls_are_read_out_of_the_text(name):
    text, want = ANSWERS[name]
    assert summary(read_all(text)) == want


@pytest.mark.parametrize("name", ANSWERS)
@pytest.mark.parametrize("size", [1, 2, 3, 7])
def test_pieces_as_they_stream_read_the_same(name, size):
    text, want = ANSWERS[name]
    assert summary(piecewise(text, size)) == want


def test_each_call_gets_its_own_id():
    starts = [p for p in read_all(f"{PARIS}\n{NOON}") if isinstance(p, CallStart)]
    assert len({s.id for s in starts}) == 2
    assert all(s.id.startswith("call_") and len(s.id) == 29 for s in starts)


def test_arguments_stream_before_the_call_ends():
    reader = CallReader()
    assert summary(reader.feed(PARIS[: PARIS.index("Par") + 3])) == [
        ("call", 0, "get_weather", '{"city": "Par')
    ]
    assert [type(p) for p in reader.feed(PARIS[PARIS.index("Par") + 3 :])] == [
        CallArguments,
        CallEnd,
    ]
    assert reader.calls == 1


def test_plain_messages_write_tools_calls_and_results_as_text():
    messages = [
        {"role": "user", "content": "Weather in Paris, and the time?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "call_1", "name": "get_weather", "arguments": {"city": "Paris"}},
                {"id": "call_2", "name": "get_time", "arguments": {"zone": "UTC"}},
            ],
        },
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
        {"role": "tool", "content": "noon", "tool_call_id": "call_2"},
    ]
    plain = tools.plain_messages(messages, (WEATHER, TIME))
    assert [m["role"] for m in plain] == ["system", "user", "assistant", "user"]
    assert plain[0]["content"].startswith(tools.DEFAULT_SYSTEM + "\n\n# Tools")
    assert json.dumps(WEATHER.spec()) in plain[0]["content"]
    assert plain[2]["content"] == f"{PARIS}\n{NOON}"
    assert plain[3]["content"] == (
        "<tool_response>\nsunny\n</tool_response>\n<tool_response>\nnoon\n</tool_response>"
    )
    assert all(set(m) == {"role", "content"} for m in plain)


def test_plain_messages_keep_a_conversation_without_tools_as_it_was():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert tools.plain_messages(messages, None) == messages
    with_tools = tools.plain_messages(messages, (TIME,))
    assert with_tools[0]["content"].startswith("Be brief.\n\n# Tools")
    assert with_tools[1:] == messages[1:]


@pytest.mark.parametrize("tags_are_tokens", [False, True])
def test_the_grammar_names_only_the_chosen_function(tags_are_tokens):
    both = tools.grammar(ToolUse((WEATHER, TIME), "required"), tags_are_tokens)
    named = tools.grammar(ToolUse((WEATHER, TIME), "get_time"), tags_are_tokens)
    assert "get_weather" in both and "get_time" in both
    assert "get_weather" not in named and "get_time" in named
    tag = "<tool_call>" if tags_are_tokens else '"<tool_call>"'
    assert f"call: {tag} rest" in both


def test_only_auto_allows_text_and_only_parallel_repeats():
    assert "TEXT" not in tools.grammar(ToolUse((TIME,), "required"), False)
    assert "TEXT" in tools.grammar(ToolUse((TIME,), "auto"), False)
    assert "call)*" in tools.grammar(ToolUse((TIME,), "auto", parallel=True), False)
    assert "call)*" not in tools.grammar(ToolUse((TIME,), "auto", parallel=False), False)


def test_argument_schemas_keep_their_root_and_get_the_layout():
    schema = {"$defs": {"c": {"type": "string"}}, "properties": {"x": {"$ref": "#/$defs/c"}}}
    arguments = tools.argument_schema(schema)
    assert arguments["$defs"] == schema["$defs"] and arguments["type"] == "object"
    assert arguments["x-guidance"]["item_separator"] == ", "
