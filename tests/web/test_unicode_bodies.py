"""Issue 34: a JSON escape that decodes to a lone surrogate ("\\ud800", valid JSON, not valid
Unicode) anywhere in a body, key or value, at any depth, is a 400 naming where it is, on
both routes, streamed or not; before, one in a tool's description, a schema's property name
or enum, or a call's arguments reached the tokenizer or the grammar and answered 500."""

from __future__ import annotations

import json

import pytest

from tests.support.httpclient import request

WEATHER = {
    "name": "get_weather",
    "description": "Get the weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}


def with_tool(**changes) -> dict:
    return {**WEATHER, **changes}


def call_message(arguments) -> dict:
    call = {"id": "call_1", "type": "function"}
    call["function"] = {"name": "get_weather", "arguments": arguments}
    return {"role": "assistant", "content": None, "tool_calls": [call]}


ASK = {"role": "user", "content": "Weather in Paris?"}
RESULT = {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}
SCHEMA = {"type": "object", "properties": {"a": {"enum": ["x", "\ud800"]}}}
CASES = [
    # (route, body, the path the error names: None for a name at the top)
    (
        "/chat",
        {"message": "hi", "tools": [with_tool(description="\ud800")]},
        "tools[0].description",
    ),
    (
        "/chat",
        {"message": "hi", "tools": [with_tool(parameters={"properties": {"\udfff": {}}})]},
        "tools[0].parameters.properties",
    ),
    ("/chat", {"message": "hi", "\ud800": 1}, None),
    (
        "/v1/chat/completions",
        {"messages": [ASK, call_message('{"city": "\ud800"}'), RESULT], "tools": [
            {"type": "function", "function": WEATHER}
        ]},
        "messages[1].tool_calls[0].function.arguments",
    ),
    (
        "/v1/chat/completions",
        {
            "messages": [ASK],
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": SCHEMA},
            },
        },
        "response_format.json_schema.schema.properties.a.enum[1]",
    ),
    (
        "/v1/chat/completions",
        {"messages": [ASK], "tools": [{"type": "function", "function": with_tool(
            parameters={"type": "object", "properties": {"c": {"description": "\udfff"}}}
        )}]},
        "tools[0].function.parameters.properties.c.description",
    ),
]  # fmt: skip


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("route, body, path", CASES)
def test_a_lone_surrogate_anywhere_is_a_400_naming_where(fake_server, route, body, path, stream):
    server = fake_server()
    raw = json.dumps({**body, "stream": stream}).encode()  # json escapes it: "\\ud800"
    assert b"\\ud" in raw
    reply = request(server.url, "POST", route, raw=raw)
    assert reply.status == 400, reply.body
    error = reply.json()["error"]
    assert "not valid Unicode text" in error["message"]
    assert (f"'{path}'" if path else "the body") in error["message"]
    if route.startswith("/v1"):
        assert error["param"] == path
    assert server.engine.ran == []


def test_a_valid_pair_of_surrogates_is_an_emoji_and_passes(fake_server):
    server = fake_server()
    raw = json.dumps({"message": "hi \U0001f600", "stop": ["\U0001f600"]})
    reply = request(server.url, "POST", "/chat", raw=raw.encode())
    assert reply.status == 200, reply.body


def test_a_refused_number_is_shown_as_sent(fake_server):
    server = fake_server()
    reply = request(server.url, "POST", "/chat", {"message": "hi", "top_p": 1.0000001})
    assert reply.status == 400
    assert "got 1.0000001" in reply.json()["error"]["message"]
