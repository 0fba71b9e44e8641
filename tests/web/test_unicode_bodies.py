"""Issue 34: a JSON escape that decodes to a lone surrogate ("\\ud800", valid JSON, not valid
Unicode) anywhere in a body, key or value, at any depth, is a 400 naming where it is, on
both routes, streamed or not; before, one in a tool's description, a schema's property name
or enum, or a call's arguments reached the tokenizer or the grammar and answered 500."""

from __future__ import annotations

import json

import pytest

from tests.support.httpclient import request

BAD = "\ud800"  # json.dumps writes it as the escape "\\ud800", valid JSON
ROUTES = ["/chat", "/v1/chat/completions"]
WEATHER = {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}
ASK = {"role": "user", "content": "Weather in Paris?"}


def tool(route: str, **changes) -> tuple[dict, str]:
    """One tool in the route's shape, and its path."""
    function = {**WEATHER, **changes}
    if route == "/chat":
        return function, "tools[0]"
    return {"type": "function", "function": function}, "tools[0].function"


def called(route: str, arguments) -> tuple[list[dict], str]:
    """A conversation whose assistant turn called get_weather, and the arguments' path."""
    if route == "/chat":
        call, where = {"id": "call_1", "name": "get_weather", "arguments": arguments}, ""
    else:
        function = {"name": "get_weather", "arguments": arguments}
        call, where = {"id": "call_1", "type": "function", "function": function}, ".function"
    turn = {"role": "assistant", "content": None, "tool_calls": [call]}
    result = {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}
    return [ASK, turn, result], f"messages[1].tool_calls[0]{where}.arguments"


def schema(route: str, value: dict) -> tuple[dict, str]:
    """The body's fields asking for JSON following `value`, and the schema's path."""
    if route == "/chat":
        return {"format": value}, "format"
    wrapped = {"type": "json_schema", "json_schema": {"name": "x", "schema": value}}
    return {"response_format": wrapped}, "response_format.json_schema.schema"


def place(route: str, where: str) -> tuple[dict, str | None]:
    """(body, the path its error names) with BAD at `where`."""
    plain = {"messages": [ASK]}
    if where == "content":
        return {"messages": [{"role": "user", "content": BAD}]}, "messages[0].content"
    if where.startswith("schema"):
        properties = {
            "schema key": {BAD: {"type": "string"}},
            "schema value": {"a": {"type": "string", "description": BAD}},
            "schema enum": {"a": {"enum": ["x", BAD]}},
        }[where]
        fields, path = schema(route, {"type": "object", "properties": properties})
        suffix = {"schema key": "", "schema value": ".a.description", "schema enum": ".a.enum[1]"}
        return {**plain, **fields}, f"{path}.properties{suffix[where]}"
    if where == "tool description":
        entry, path = tool(route, description=BAD)
        return {**plain, "tools": [entry]}, f"{path}.description"
    if where.startswith("call arguments"):
        as_object = where.endswith("object")
        messages, path = called(route, {"city": BAD} if as_object else '{"city": "' + BAD + '"}')
        entry, _ = tool(route)
        return {"messages": messages, "tools": [entry]}, path + (".city" if as_object else "")
    if where == "tool result":
        messages, _ = called(route, {"city": "Paris"})
        messages[2] = {**messages[2], "content": BAD}
        return {"messages": messages, "tools": [tool(route)[0]]}, "messages[2].content"
    if where == "stop":
        return {**plain, "stop": ["ok", BAD]}, "stop[1]"
    if where == "user":
        return {**plain, "user": BAD}, "user"
    assert where == "a name at the top"
    return {**plain, BAD: 1}, None


PLACES = [
    "content",
    "schema key",
    "schema value",
    "schema enum",
    "tool description",
    "call arguments string",
    "call arguments object",
    "tool result",
    "stop",
    "user",
    "a name at the top",
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("where", PLACES)
def test_a_lone_surrogate_anywhere_is_a_400_naming_where(fake_server, caplog, route, where, stream):
    server = fake_server()
    body, path = place(route, where)
    raw = json.dumps({**body, "stream": stream}).encode()
    assert b"\\ud800" in raw
    reply = request(server.url, "POST", route, raw=raw)
    assert reply.status == 400, reply.body
    error = reply.json()["error"]
    assert "not valid Unicode text" in error["message"]
    assert (f"'{path}'" if path else "the body") in error["message"]
    if route.startswith("/v1"):
        assert error["param"] == path
    assert server.engine.ran == []
    assert b"Traceback" not in reply.body
    assert not [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")]


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
