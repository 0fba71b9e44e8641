"""Issue 63: thinking over HTTP. The switch of each dialect (/chat `think`, /v1
`chat_template_kwargs.enable_thinking` and `reasoning_effort`, Ollama's `think`) reaches the
prompt as the same value, the server's --thinking when a request says nothing; a scripted
model's thought comes back apart from the answer in each dialect's names, streamed or not,
and never in the answer's text; a model that does not think refuses an explicit switch."""

from __future__ import annotations

import json

import pytest

from tests.support.fakes import FakeEngine
from tests.support.httpclient import request

THOUGHT = ["It is ", "the capital", " of France."]
REPLY = ["Paris", " is the", " answer."]
ASK = [{"role": "user", "content": "Capital of France?"}]


def sse_data(server, path: str, body: dict) -> list[dict]:
    """A stream's `data:` events, read whole."""
    reply = request(server.url, "POST", path, {**body, "stream": True})
    assert reply.status == 200, reply.body
    lines = reply.body.decode().splitlines()
    return [json.loads(x[6:]) for x in lines if x.startswith("data: ") and x != "data: [DONE]"]


def thinking_server(fake_server, *flags: str):
    server = fake_server(FakeEngine(token_s=0.0, thought=THOUGHT, reply=REPLY), *flags)
    server.runtime.prompts.thinks = True
    return server


BODIES = {
    "/chat": {"messages": ASK},
    "/v1/chat/completions": {"messages": ASK},
    "/api/chat": {"model": "m", "messages": ASK, "stream": False},
    "/api/generate": {"model": "m", "prompt": "Capital of France?", "stream": False},
}
SWITCHES = {  # (route, fields, the switch the prompt gets)
    "chat on": ("/chat", {"think": True}, True),
    "chat off": ("/chat", {"think": False}, False),
    "v1 kwargs on": (
        "/v1/chat/completions",
        {"chat_template_kwargs": {"enable_thinking": True}},
        True,
    ),
    "v1 kwargs off": (
        "/v1/chat/completions",
        {"chat_template_kwargs": {"enable_thinking": False}},
        False,
    ),
    "v1 effort none": ("/v1/chat/completions", {"reasoning_effort": "none"}, False),
    "v1 effort high": ("/v1/chat/completions", {"reasoning_effort": "high"}, True),
    "ollama on": ("/api/chat", {"think": True}, True),
    "ollama level": ("/api/chat", {"think": "low"}, True),
    "ollama off": ("/api/chat", {"think": False}, False),
    "nothing said": ("/chat", {}, None),
}


@pytest.mark.parametrize("route, fields, switch", SWITCHES.values(), ids=SWITCHES.keys())
def test_each_dialects_switch_reaches_the_prompt_as_the_same_value(
    fake_server, route, fields, switch
):
    server = thinking_server(fake_server)
    reply = request(server.url, "POST", route, {**BODIES[route], **fields})
    assert reply.status == 200, reply.body
    assert server.runtime.prompts.think is switch


@pytest.mark.parametrize("setting, switch", [("on", True), ("off", False), ("auto", None)])
def test_the_servers_setting_is_the_switch_when_a_request_says_nothing(
    fake_server, setting, switch
):
    server = thinking_server(fake_server, "--thinking", setting)
    for route in BODIES:
        assert request(server.url, "POST", route, BODIES[route]).status == 200
        assert server.runtime.prompts.think is switch
    said = request(server.url, "POST", "/chat", {"messages": ASK, "think": not switch})
    assert said.status == 200 and server.runtime.prompts.think is (not switch)


def test_the_thought_comes_apart_in_each_dialects_names(fake_server):
    server = thinking_server(fake_server)
    thought, answer = "".join(THOUGHT), "".join(REPLY)
    chat = request(server.url, "POST", "/chat", BODIES["/chat"]).json()
    assert (chat["reasoning"], chat["response"]) == (thought, answer)
    v1 = request(server.url, "POST", "/v1/chat/completions", BODIES["/v1/chat/completions"])
    message = v1.json()["choices"][0]["message"]
    assert message["reasoning_content"] == message["reasoning"] == thought
    assert message["content"] == answer
    ollama = request(server.url, "POST", "/api/chat", BODIES["/api/chat"]).json()["message"]
    assert (ollama["thinking"], ollama["content"]) == (thought, answer)
    generate = request(server.url, "POST", "/api/generate", BODIES["/api/generate"]).json()
    assert (generate["thinking"], generate["response"]) == (thought, answer)


def test_streamed_the_thought_comes_first_and_never_in_the_answer(fake_server):
    server = thinking_server(fake_server)
    thought, answer = "".join(THOUGHT), "".join(REPLY)
    events = sse_data(server, "/chat", BODIES["/chat"])
    assert "".join(e.get("reasoning", "") for e in events) == thought
    assert "".join(e.get("delta", "") for e in events) == answer
    first_answer = next(i for i, e in enumerate(events) if e.get("delta"))
    assert all("reasoning" not in e for e in events[first_answer:])
    chunks = sse_data(server, "/v1/chat/completions", BODIES["/v1/chat/completions"])
    deltas = [c["choices"][0]["delta"] for c in chunks if c.get("choices")]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == thought
    assert "".join(d.get("reasoning", "") for d in deltas) == thought
    assert "".join(d.get("content") or "" for d in deltas) == answer
    lines = request(server.url, "POST", "/api/chat", {**BODIES["/api/chat"], "stream": True})
    messages = [json.loads(x)["message"] for x in lines.body.decode().splitlines()]
    assert "".join(m.get("thinking", "") for m in messages) == thought
    assert "".join(m["content"] for m in messages) == answer


def test_an_earlier_turns_thought_sent_back_is_taken(fake_server):
    server = thinking_server(fake_server)
    turn = [*ASK, {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "Sure?"}]
    sent = [
        ("/chat", {"messages": [turn[0], {**turn[1], "reasoning": "a capital"}, turn[2]]}),
        (
            "/v1/chat/completions",
            {"messages": [turn[0], {**turn[1], "reasoning_content": "x"}, turn[2]]},
        ),
        ("/v1/chat/completions", {"messages": [turn[0], {**turn[1], "reasoning": "x"}, turn[2]]}),
        (
            "/api/chat",
            {**BODIES["/api/chat"], "messages": [turn[0], {**turn[1], "thinking": "x"}, turn[2]]},
        ),
    ]
    for route, body in sent:
        reply = request(server.url, "POST", route, body)
        assert reply.status == 200, (route, reply.body)


@pytest.mark.parametrize(
    "route, fields, param",
    [
        ("/chat", {"think": True}, "think"),
        (
            "/v1/chat/completions",
            {"chat_template_kwargs": {"enable_thinking": True}},
            "chat_template_kwargs",
        ),
        ("/api/chat", {"think": True}, "think"),
    ],
)
def test_a_model_that_does_not_think_refuses_an_explicit_switch(fake_server, route, fields, param):
    server = fake_server(FakeEngine(token_s=0.0))
    reply = request(server.url, "POST", route, {**BODIES[route], **fields})
    assert reply.status == 400 and "does not think" in reply.body.decode(), reply.body
    assert request(server.url, "POST", route, {**BODIES[route], "stream": False}).status == 200


def test_reasoning_effort_is_a_hint_a_model_that_does_not_think_ignores(fake_server):
    server = fake_server(FakeEngine(token_s=0.0))
    body = {**BODIES["/v1/chat/completions"], "reasoning_effort": "medium"}
    assert request(server.url, "POST", "/v1/chat/completions", body).status == 200


@pytest.mark.parametrize(
    "route, fields",
    [
        ("/chat", {"think": "yes"}),
        ("/v1/chat/completions", {"reasoning_effort": "max"}),
        ("/v1/chat/completions", {"chat_template_kwargs": {"enable_thinking": 1}}),
        ("/v1/chat/completions", {"chat_template_kwargs": {"thinking": True}}),
        ("/api/chat", {"think": "hard"}),
    ],
)
def test_a_bad_switch_is_a_400(fake_server, route, fields):
    server = thinking_server(fake_server)
    assert request(server.url, "POST", route, {**BODIES[route], **fields}).status == 400


def test_the_official_clients_read_the_thought(fake_server):
    """openai (its `reasoning_content`, an extra field) and ollama (`message.thinking`, a
    field of its own since 0.5), whole and streamed."""
    import ollama
    import openai

    server = thinking_server(fake_server)
    thought, answer = "".join(THOUGHT), "".join(REPLY)
    on = {"chat_template_kwargs": {"enable_thinking": True}}
    oa = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
    message = oa.chat.completions.create(model="m", messages=ASK, extra_body=on).choices[0].message
    assert message.content == answer and message.model_extra["reasoning_content"] == thought
    chunks = list(oa.chat.completions.create(model="m", messages=ASK, extra_body=on, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join((d.model_extra or {}).get("reasoning_content", "") for d in deltas) == thought
    assert "".join(d.content or "" for d in deltas) == answer
    ol = ollama.Client(host=server.url)
    whole = ol.chat(model="m", messages=ASK, think=True)
    assert (whole.message.thinking, whole.message.content) == (thought, answer)
    parts = list(ol.chat(model="m", messages=ASK, think=True, stream=True))
    assert "".join(p.message.thinking or "" for p in parts) == thought
    assert "".join(p.message.content or "" for p in parts) == answer
    generated = ol.generate(model="m", prompt="Capital of France?", think=True)
    assert (generated.thinking, generated.response) == (thought, answer)
