"""Counting before sending (/tokenize, /detokenize): through the real server and the embedded
model, a body's count is the `prompt_tokens` its answer reports, on /chat and on /v1, with
and without tools; the limits it shows are the ones the 413 applies; plain text round-trips;
bad token lists are refused in the route's dialect; the keys guard these routes too."""

from __future__ import annotations

import pytest

from tests.support import schemas
from tests.support.fakes import FakeEngine
from tests.support.httpclient import chat, request
from tests.support.keys import KEY

ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]
V1_TOOLS = [{"type": "function", "function": schemas.WEATHER}]
CHAT_TOOLS = [schemas.WEATHER]


def counted(server, path: str, body: dict) -> dict:
    reply = request(server.url, "POST", path, body)
    assert reply.status == 200, reply.text
    found = reply.json()
    assert found["count"] == len(found["tokens"]) > 0
    return found


@pytest.mark.parametrize("tools", [None, CHAT_TOOLS], ids=["plain", "tools"])
def test_a_chat_body_counts_what_its_answer_reports(embedded_server, tools):
    body = {"messages": ASK, "system": "Answer in one word."}
    if tools:
        body["tools"] = tools
    found = counted(embedded_server, "/tokenize", body)
    answer = chat(embedded_server.url, {**body, "max_tokens": 1}).json()
    assert found["count"] == answer["usage"]["prompt_tokens"]


@pytest.mark.parametrize("tools", [None, V1_TOOLS], ids=["plain", "tools"])
def test_an_openai_body_counts_what_its_usage_reports(embedded_server, tools):
    body = {"model": "any", "messages": ASK}
    if tools:
        body["tools"] = tools
    found = counted(embedded_server, "/v1/tokenize", body)
    reply = request(embedded_server.url, "POST", "/v1/chat/completions", {**body, "max_tokens": 1})
    assert found["count"] == reply.json()["usage"]["prompt_tokens"]


def test_tools_are_counted(embedded_server):
    bare = counted(embedded_server, "/tokenize", {"messages": ASK})["count"]
    with_tools = counted(embedded_server, "/tokenize", {"messages": ASK, "tools": CHAT_TOOLS})
    assert with_tools["count"] > bare


def test_the_limits_shown_are_the_ones_the_413_applies(embedded_server):
    long = {"message": "hello " * 3500}  # past the 3072 default, within the context
    found = counted(embedded_server, "/tokenize", long)
    assert found["fits"] is False and found["count"] > found["max_prompt_tokens"]
    assert found["max_prompt_tokens"] < found["context_tokens"]
    refused = chat(embedded_server.url, long)
    assert refused.status == 413
    message = refused.json()["error"]["message"]
    assert f"{found['count']} tokens" in message
    assert f"at most {found['max_prompt_tokens']} prompt tokens" in message
    assert counted(embedded_server, "/tokenize", {"message": "hi"})["fits"] is True


def test_plain_text_round_trips(embedded_server):
    text = "Plain text, <|im_end|> read as characters: ü ∑ 🙂"
    found = counted(embedded_server, "/tokenize", {"prompt": text})
    templated = counted(embedded_server, "/tokenize", {"message": text})["count"]
    assert found["count"] < templated  # no template around it
    for path in ("/detokenize", "/v1/detokenize"):
        back = request(embedded_server.url, "POST", path, {"tokens": found["tokens"]})
        assert back.status == 200 and back.json() == {"prompt": text}


@pytest.mark.parametrize(
    "tokens", [[-1], [10**9], "12", [1.5], [True]], ids=["negative", "past", "str", "float", "b"]
)
def test_bad_token_lists_are_a_400_in_the_route_dialect(embedded_server, tokens):
    chat_error = request(embedded_server.url, "POST", "/detokenize", {"tokens": tokens})
    assert chat_error.status == 400
    assert chat_error.json()["error"]["type"] == "invalid_request"
    assert "'tokens'" in chat_error.json()["error"]["message"]
    v1_error = request(embedded_server.url, "POST", "/v1/detokenize", {"tokens": tokens})
    assert v1_error.status == 400 and v1_error.json()["error"]["param"] == "tokens"


def test_a_bad_body_is_refused_as_its_route_refuses_it(embedded_server):
    reply = request(embedded_server.url, "POST", "/tokenize", {"messages": ASK, "oops": 1})
    assert reply.status == 400 and "oops" in reply.json()["error"]["message"]
    reply = request(embedded_server.url, "POST", "/v1/tokenize", {"messages": "nope"})
    assert reply.status == 400 and reply.json()["error"]["param"] == "messages"


def test_the_keys_guard_them(fake_server):
    server = fake_server(FakeEngine(token_s=0.0))
    server.runtime.keys.replace({"wiki": KEY.encode()})
    for path, body in [("/tokenize", {"prompt": "hi"}), ("/v1/detokenize", {"tokens": [1]})]:
        assert request(server.url, "POST", path, body).status == 401
    key = {"Authorization": f"Bearer {KEY}"}
    reply = request(server.url, "POST", "/tokenize", {"prompt": "hi"}, headers=key)
    assert reply.status == 200 and reply.json()["tokens"] == [ord("h"), ord("i")]


def refusal_cases() -> list[tuple[str, object]]:
    """(chat route, body) pairs: the bodies the chat routes' own tests refuse, and bodies
    only the tokenizer, the grammar or the vocabulary can refuse."""
    from tests.test_fuzz import HOSTILE_SCHEMAS, nested
    from tests.web.dialects.test_tools_http import ASK as V1_ASK
    from tests.web.dialects.test_tools_http import BAD as V1_TOOL_BODIES
    from tests.web.test_http import BAD_BODIES
    from tests.web.test_unicode_bodies import PLACES, ROUTES, place

    cases: list[tuple[str, object]] = [("/chat", p.values[0]) for p in BAD_BODIES]
    cases += [(route, place(route, where)[0]) for route in ROUTES for where in PLACES]
    cases += [
        ("/v1/chat/completions", {"messages": V1_ASK, **b}) for b, _ in V1_TOOL_BODIES.values()
    ]
    for schema in [*HOSTILE_SCHEMAS, nested(40), {"type": "object", "properties": {"a": 1}}]:
        cases.append(("/chat", {"messages": ASK, "format": schema}))
        wrapped = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
        cases.append(("/v1/chat/completions", {"messages": ASK, "response_format": wrapped}))
    cases += [
        ("/v1/chat/completions", {"messages": ASK, "logit_bias": {"999999": 1}}),
        ("/chat", {"messages": ASK, "logit_bias": {"49152": -100}}),
        ("/chat", {"messages": ASK, "tools": [{**schemas.WEATHER, "parameters": nested(40)}]}),
    ]
    return cases


TOKENIZE = {"/chat": "/tokenize", "/v1/chat/completions": "/v1/tokenize"}
# A schema that compiles and dead-ends only later in an answer is the answer's error, not a
# refusal of the body: /tokenize, which writes no answer, cannot meet it.
IN_THE_ANSWER = "allows no further output after"


def test_the_tokenize_routes_refuse_every_body_their_chat_route_refuses(embedded_server):
    refused = 0
    for route, body in refusal_cases():
        if isinstance(body, dict) and "max_tokens" not in body:
            body = {**body, "max_tokens": 1}
        chat_reply = request(embedded_server.url, "POST", route, body)
        if chat_reply.status != 400 or IN_THE_ANSWER in chat_reply.body.decode():
            continue
        refused += 1
        reply = request(embedded_server.url, "POST", TOKENIZE[route], body)
        assert reply.status == 400, (route, body, reply.body)
        assert reply.json()["error"] == chat_reply.json()["error"], (route, body)
    assert refused >= 100
