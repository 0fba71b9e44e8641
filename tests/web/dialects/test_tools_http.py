"""Tool calling over HTTP with the scripted engine, which writes a call's text as the grammar
would have it (the grammar itself: tests/inference/runtime/test_tool_grammar.py): answer and
stream shapes on /v1 and /chat, the official client's own stream accumulation, and a clear
400 naming the field for every bad tool input."""

from __future__ import annotations

import json

import openai
import pytest

from inference.runtime.tools import call_text
from tests.support import schemas
from tests.support.fakes import FakeEngine, FakeGrammars
from tests.support.httpclient import Stream, request

PATH = "/v1/chat/completions"
ASK = [{"role": "user", "content": "Weather in Paris?"}]
WEATHER = {"type": "function", "function": schemas.WEATHER}
TIME = {"type": "function", "function": schemas.TIME}
TOOLS = [WEATHER, TIME]
PARIS = call_text("get_weather", {"city": "Paris"})
NOON = call_text("get_time", {"zone": "UTC"})


def pieces(text: str, size: int = 5) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


@pytest.fixture
def serve(fake_server):
    """A scripted server whose engine answers `text`, with a stand-in grammar compiler."""

    def start(text: str):
        server = fake_server(FakeEngine(token_s=0.0, reply=pieces(text)))
        server.runtime.grammars = FakeGrammars()
        return server

    return start


def completion(server, body: dict):
    return request(server.url, "POST", PATH, {"messages": ASK, **body})


def test_a_call_is_the_messages_tool_calls(serve):
    server = serve(PARIS)
    reply = completion(server, {"tools": TOOLS, "tool_choice": "required"})
    assert reply.status == 200, reply.body
    [choice] = reply.json()["choices"]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["content"] is None
    [call] = message["tool_calls"]
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}


def test_each_function_schema_is_compiled_naming_its_field_then_the_call_grammar(serve):
    server = serve(PARIS)
    completion(server, {"tools": TOOLS})
    params = [param for _, param in server.runtime.grammars.schemas]
    assert params == ["tools[0].function.parameters", "tools[1].function.parameters"]
    [lark] = server.runtime.grammars.larks
    assert "TEXT" in lark  # auto: the default with tools


def test_text_then_calls_and_text_alone(serve):
    body = completion(serve(f"Let me look.\n{PARIS}\n{NOON}"), {"tools": TOOLS}).json()
    message = body["choices"][0]["message"]
    assert message["content"] == "Let me look."
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather", "get_time"]
    body = completion(serve("It is sunny."), {"tools": TOOLS}).json()
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "It is sunny."}
    assert body["choices"][0]["finish_reason"] == "stop"


def test_with_tool_choice_none_no_call_is_read_nor_constrained(serve):
    server = serve(PARIS)
    body = completion(server, {"tools": TOOLS, "tool_choice": "none"}).json()
    assert body["choices"][0]["message"]["content"] == PARIS
    assert server.runtime.grammars.larks == []


def stream_events(server, body: dict, path: str = PATH) -> list:
    stream = Stream(server.url, {"messages": ASK, **body}, path=path)
    try:
        assert stream.status == 200
        return [data for _, data in stream.events()]
    finally:
        stream.close()


def test_a_streamed_call_comes_as_openai_sends_it(serve):
    events = stream_events(serve(f"{PARIS}\n{NOON}"), {"tools": TOOLS})
    assert events[-1] == "[DONE]"
    deltas = [e["choices"][0]["delta"] for e in events[:-1]]
    assert deltas[0] == {"role": "assistant", "content": None}
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    firsts = [c for c in calls if "id" in c]
    assert [(c["index"], c["type"], c["function"]) for c in firsts] == [
        (0, "function", {"name": "get_weather", "arguments": ""}),
        (1, "function", {"name": "get_time", "arguments": ""}),
    ]
    for index, want in enumerate(['{"city": "Paris"}', '{"zone": "UTC"}']):
        parts = [c["function"]["arguments"] for c in calls if c["index"] == index]
        assert "".join(parts) == want
        assert parts[0] == "" and len(parts) > 2  # the name first, then the pieces
    assert events[-2]["choices"][0]["finish_reason"] == "tool_calls"


def test_the_official_client_reads_calls_whole_and_streamed(serve):
    server = serve(f"{PARIS}\n{NOON}")
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    whole = client.chat.completions.create(
        model="deskchat", messages=ASK, tools=TOOLS, tool_choice="required"
    )
    with client.chat.completions.stream(
        model="deskchat", messages=ASK, tools=TOOLS, tool_choice="required"
    ) as stream:
        for _ in stream:
            pass
        streamed = stream.get_final_completion()
    for reply in (whole, streamed):
        [choice] = reply.choices
        assert choice.finish_reason == "tool_calls"
        calls = choice.message.tool_calls
        assert [(c.function.name, c.function.arguments) for c in calls] == [
            ("get_weather", '{"city": "Paris"}'),
            ("get_time", '{"zone": "UTC"}'),
        ]
        assert choice.message.content in (None, "")
        # An agent loop sends the message back as the client returned it, then the results.
        results = [{"role": "tool", "tool_call_id": c.id, "content": "ok"} for c in calls]
        again = client.chat.completions.create(
            model="deskchat", messages=[*ASK, choice.message, *results], tools=TOOLS
        )
        assert again.choices[0].finish_reason == "tool_calls"


CHAT_TOOLS = [schemas.WEATHER, schemas.TIME]


def test_chat_gives_whole_calls_with_objects(serve):
    server = serve(f"Checking.\n{PARIS}")
    reply = request(server.url, "POST", "/chat", {"messages": ASK, "tools": CHAT_TOOLS})
    body = reply.json()
    assert reply.status == 200, body
    assert body["response"] == "Checking." and body["finish_reason"] == "tool_calls"
    [call] = body["tool_calls"]
    assert call["name"] == "get_weather" and call["arguments"] == {"city": "Paris"}
    events = stream_events(serve(f"Checking.\n{PARIS}"), {"tools": CHAT_TOOLS}, path="/chat")
    assert "".join(e["delta"] for e in events if "delta" in e) == "Checking."
    [whole] = [e["tool_call"] for e in events if "tool_call" in e]
    assert {**whole, "id": None} == {
        "index": 0,
        "id": None,
        "name": "get_weather",
        "arguments": {"city": "Paris"},
    }
    assert events[-1]["done"] and events[-1]["finish_reason"] == "tool_calls"


def test_chat_takes_a_tool_conversation_and_a_named_choice(serve):
    # A named choice lets the answer hold calls and nothing else: scripted as the grammar
    # would have it (text would be dropped, issue 34)
    server = serve(PARIS)
    messages = [
        *ASK,
        {
            "role": "assistant",
            "tool_calls": [{"id": "call_1", "name": "get_weather", "arguments": {"city": "P"}}],
        },
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
    ]
    body = {"messages": messages, "tools": CHAT_TOOLS, "tool_choice": "get_weather"}
    reply = request(server.url, "POST", "/chat", body)
    assert reply.status == 200, reply.body
    answer = reply.json()
    assert answer["response"] == "" and answer["finish_reason"] == "tool_calls", answer
    assert [(c["name"], c["arguments"]) for c in answer["tool_calls"]] == [
        ("get_weather", {"city": "Paris"})
    ]


AGENT_HISTORY = [
    *ASK,
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_9",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_9", "content": "sunny"},
]


def test_the_second_round_of_an_agent_loop_is_taken(serve):
    reply = completion(serve("It is sunny."), {"messages": AGENT_HISTORY, "tools": TOOLS})
    assert reply.status == 200, reply.body


def with_history(**changes) -> list[dict]:
    """AGENT_HISTORY with one key of the assistant's call or the tool message changed."""
    history = json.loads(json.dumps(AGENT_HISTORY))
    for key, value in changes.items():
        target, field = key.split("__")
        entry = history[1]["tool_calls"][0]["function"] if target == "call" else history[2]
        if value is None:
            del entry[field]
        else:
            entry[field] = value
    return history


BAD = {
    "unknown tool in tool_choice": (
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "tool_choice",
    ),
    "tool_choice of another shape": ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
    "required without tools": ({"tool_choice": "required"}, "tool_choice"),
    "tools not a list": ({"tools": WEATHER}, "tools"),
    "a tool without a name": (
        {"tools": [{"type": "function", "function": {"description": "x"}}]},
        "tools[0].function.name",
    ),
    "a bad name": (
        {"tools": [{"type": "function", "function": {"name": "get weather"}}]},
        "tools[0].function.name",
    ),
    "not a function": ({"tools": [{"type": "code_interpreter"}]}, "tools[0]"),
    "parameters that are not a schema": (
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
        "tools[0].function.parameters",
    ),
    "parameters not of an object": (
        {
            "tools": [
                {"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}
            ]
        },
        "tools[0].function.parameters",
    ),
    "a name twice": ({"tools": [TIME, TIME]}, "tools"),
    "too many tools": (
        {"tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(33)]},
        "tools",
    ),
    "parallel_tool_calls not a flag": (
        {"tools": TOOLS, "parallel_tool_calls": "yes"},
        "parallel_tool_calls",
    ),
    "tools with a JSON answer": (
        {"tools": TOOLS, "response_format": {"type": "json_object"}},
        "response_format",
    ),
    "a tool result without tool_call_id": (
        {"messages": with_history(tool__tool_call_id=None)},
        "messages",
    ),
    "a tool result for no call": ({"messages": with_history(tool__tool_call_id="c")}, "messages"),
    "arguments that are not JSON": (  # parsed as the body is: named to the field
        {"messages": with_history(call__arguments="{city: Paris}")},
        "messages[1].tool_calls[0].function.arguments",
    ),
    "a call without its name": ({"messages": with_history(call__name=None)}, "messages"),
    "a tool result alone": (
        {"messages": [{"role": "tool", "content": "x", "tool_call_id": "c"}]},
        "messages",
    ),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_tool_input_is_a_400_naming_the_field(serve, case):
    body, param = BAD[case]
    server = serve(PARIS)
    reply = completion(server, body)
    assert reply.status == 400, reply.body
    error = reply.json()["error"]
    assert error["param"] == param and error["code"] == "invalid_request", error
    assert server.engine.ran == []


CHAT_BAD = {
    "an OpenAI-shaped tool": ({"tools": [WEATHER]}, "tools[0]"),
    "a choice naming no tool": ({"tools": CHAT_TOOLS, "tool_choice": "nope"}, "tool_choice"),
    "arguments that are not an object": (
        {
            "messages": [
                *ASK,
                {"role": "assistant", "tool_calls": [{"id": "c", "name": "f", "arguments": "{"}]},
                {"role": "tool", "content": "x", "tool_call_id": "c"},
            ]
        },
        "messages",
    ),
    "tools with a JSON answer": ({"tools": CHAT_TOOLS, "format": "json"}, "format"),
}


@pytest.mark.parametrize("case", CHAT_BAD)
def test_bad_tool_input_on_chat_is_a_400_naming_the_field(serve, case):
    body, param = CHAT_BAD[case]
    server = serve(PARIS)
    reply = request(server.url, "POST", "/chat", {"messages": ASK, **body})
    assert reply.status == 400, reply.body
    assert reply.json()["error"]["message"]
    assert server.engine.ran == []
    assert param  # /chat's errors carry no param; the message names the field
    assert param.split("[")[0] in reply.json()["error"]["message"]
