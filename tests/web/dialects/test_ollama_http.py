"""The Ollama routes over HTTP with the scripted engine: what a body's options become, the
stream's lines, calls and tool results, Ollama-shaped errors on every /api/ path (auth,
404, 405, 413, what waitress answers itself), the full queue's 503 as the official client
reports it, the cancel on disconnect, and the routes counted in the metrics."""

from __future__ import annotations

import json
import socket

import ollama
import pytest

from inference.runtime.tools import call_text
from tests.support import schemas
from tests.support.fakes import FakeEngine, FakeGrammars
from tests.support.httpclient import request, wait_until
from tests.support.keys import KEY
from tests.support.metrics import scrape, value
from tests.support.traffic import fill_queue
from web.dialects.ollama_request import NO_LIMIT

ASK = [{"role": "user", "content": "hello"}]
WEATHER = {"type": "function", "function": schemas.WEATHER}


def post(server, path: str, body, headers: dict | None = None):
    return request(server.url, "POST", path, body, headers=headers)


def chat(server, **fields):
    return post(server, "/api/chat", {"model": "m", "messages": ASK, "stream": False, **fields})


def lines(reply) -> list[dict]:
    return [json.loads(line) for line in reply.body.decode().splitlines()]


def assert_error(reply, status: int, *words: str) -> str:
    """An Ollama error: {"error": "..."} and nothing else, with the status and the words."""
    assert reply.status == status, reply.body
    body = reply.json()
    assert set(body) == {"error"} and isinstance(body["error"], str)
    for word in words:
        assert word in body["error"], body
    return body["error"]


def test_options_become_the_jobs_sampling_and_unknown_ones_are_ignored(fake_server):
    engine = FakeEngine(token_s=0.0)
    server = fake_server(engine)
    options = {
        **{"temperature": 0.7, "top_p": 0.9, "top_k": 5, "min_p": 0.05, "seed": 3},
        **{"repeat_penalty": 1.2, "presence_penalty": 0.5, "frequency_penalty": -0.5},
        **{"num_predict": 7, "stop": ["w9"], "num_ctx": 8192, "mirostat": 2, "numa": True},
    }
    reply = chat(server, options=options, keep_alive="5m")
    assert reply.status == 200, reply.body
    sampling = engine.samplings[-1]
    assert (sampling.temperature, sampling.top_p, sampling.top_k) == (0.7, 0.9, 5)
    assert (sampling.min_p, sampling.seed, sampling.repetition_penalty) == (0.05, 3, 1.2)
    assert (sampling.presence_penalty, sampling.frequency_penalty) == (0.5, -0.5)
    assert sampling.max_tokens == 7 and sampling.stop == ("w9",)
    assert reply.json()["eval_count"] == 7 and reply.json()["done_reason"] == "length"

    chat(server, options={"seed": -1, "num_predict": -1})  # Ollama: a random seed, no limit
    assert engine.samplings[-1].seed is None
    assert engine.samplings[-1].max_tokens == server.config.max_tokens_cap < NO_LIMIT


@pytest.mark.parametrize(
    "options, named",
    [
        ({"temperature": "hot"}, "options.temperature"),
        ({"top_k": 1.5}, "options.top_k"),
        ({"repeat_penalty": 0}, "options.repeat_penalty"),
        ({"seed": "7"}, "options.seed"),
        ({"num_predict": 0}, "options.num_predict"),
        ({"stop": "x" * 100}, "options.stop"),
        ({"tool_choice": 1}, "options.tool_choice"),
        ("fast", "options"),
    ],
)
def test_a_bad_option_is_a_400_naming_it(fake_server, options, named):
    server = fake_server(FakeEngine(token_s=0.0))
    assert_error(chat(server, options=options), 400, f"'{named}'")


@pytest.mark.parametrize(
    "fields, words",
    [
        ({"messages": [{"role": "user", "content": "hi", "images": ["aGk="]}]}, ["images"]),
        ({"images": ["aGk="]}, ["images", "text only"]),
        ({"think": True}, ["think"]),
        ({"raw": True, "system": "Be brief."}, ["system", "raw"]),
        ({"suffix": "}"}, ["suffix"]),
        ({"format": "yaml"}, ["format"]),
        ({"keep_alive": [5]}, ["keep_alive"]),
        ({"tools": [WEATHER], "format": "json"}, ["format", "tools"]),
        ({"mesages": ASK}, ["mesages"]),
        ({"messages": [{"role": "robot", "content": "hi"}]}, ["robot"]),
    ],
)
def test_what_is_not_supported_is_refused_clearly(fake_server, fields, words):
    server = fake_server(FakeEngine(token_s=0.0))
    path = "/api/generate" if {"images", "raw", "suffix"} & set(fields) else "/api/chat"
    body = {"model": "m", "stream": False, **({"prompt": "hi"} if "generate" in path else {})}
    if "generate" not in path:
        body["messages"] = ASK
    assert_error(post(server, path, {**body, **fields}), 400, *words)


def test_the_stream_is_json_lines_by_default(fake_server):
    server = fake_server(FakeEngine(token_s=0.0, reply=["Hel", "lo", "!"]))
    reply = post(server, "/api/chat", {"model": "m", "messages": ASK})
    assert reply.status == 200 and reply.headers["content-type"] == "application/x-ndjson"
    parts = lines(reply)
    assert [p["message"]["content"] for p in parts] == ["Hel", "lo", "!", ""]
    assert [p["done"] for p in parts] == [False, False, False, True]
    assert parts[-1]["done_reason"] == "stop" and parts[-1]["eval_count"] == 3
    assert all(p["model"] == "fake" and p["created_at"].endswith("Z") for p in parts)
    generated = lines(post(server, "/api/generate", {"model": "m", "prompt": "hi"}))
    assert [p["response"] for p in generated] == ["Hel", "lo", "!", ""]


def test_nothing_to_say_is_a_load_answered_at_once(fake_server):
    engine = FakeEngine(token_s=0.0)
    server = fake_server(engine)
    loaded = post(server, "/api/chat", {"model": "m", "messages": []}).json()
    assert loaded["done"] and loaded["done_reason"] == "load"
    assert loaded["message"] == {"role": "assistant", "content": ""}
    assert post(server, "/api/generate", {"model": "m"}).json()["done_reason"] == "load"
    assert engine.samplings == []


def serve_call(fake_server, text: str):
    server = fake_server(
        FakeEngine(token_s=0.0, reply=[text[i : i + 7] for i in range(0, len(text), 7)])
    )
    server.runtime.grammars = FakeGrammars()
    return server


def test_a_call_comes_with_arguments_as_an_object_whole_and_streamed(fake_server):
    server = serve_call(fake_server, call_text("get_weather", {"city": "Paris"}))
    whole = chat(server, tools=[WEATHER]).json()
    [call] = whole["message"]["tool_calls"]
    assert call["function"] == {"index": 0, "name": "get_weather", "arguments": {"city": "Paris"}}
    assert whole["done_reason"] == "stop" and whole["message"]["content"] == ""
    parts = lines(post(server, "/api/chat", {"model": "m", "messages": ASK, "tools": [WEATHER]}))
    streamed = [c for p in parts for c in p["message"].get("tool_calls", ())]
    assert [c["function"] for c in streamed] == [call["function"]]


def history(*results: dict) -> list[dict]:
    calls = [
        {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
        {"function": {"name": "get_time", "arguments": {"zone": "UTC"}}},
    ]
    return [*ASK, {"role": "assistant", "content": "", "tool_calls": calls}, *results]


def test_tool_results_answer_the_calls_before_them(fake_server):
    server = serve_call(fake_server, "fine")
    tools = [WEATHER, {"type": "function", "function": schemas.TIME}]
    by_name = [
        {"role": "tool", "content": "12:00", "tool_name": "get_time"},
        {"role": "tool", "content": "sunny", "tool_name": "get_weather"},
    ]
    assert chat(server, messages=history(*by_name), tools=tools).status == 200
    in_order = [{"role": "tool", "content": "sunny"}, {"role": "tool", "content": "12:00"}]
    assert chat(server, messages=history(*in_order), tools=tools).status == 200
    twice = [by_name[0], by_name[0]]
    assert_error(
        chat(server, messages=history(*twice), tools=tools), 400, "messages[3]", "get_time"
    )
    stray = [*ASK, {"role": "tool", "content": "sunny"}]
    assert_error(chat(server, messages=stray), 400, "messages[1]", "tool result")


def test_every_error_on_api_is_ollama_shaped(fake_server):
    server = fake_server(FakeEngine(token_s=0.0), "--max-body-bytes", "2000")
    assert_error(request(server.url, "GET", "/api/nothing"), 404, "/api/nothing")
    assert_error(request(server.url, "GET", "/api/chat"), 405)
    assert_error(post(server, "/api/chat", None, headers={"Content-Length": "0"}), 400, "JSON")
    long = [{"role": "user", "content": "x" * 5000}]
    assert_error(chat(server, messages=long), 413, "2000")
    framing = b"Transfer-Encoding: chunked\r\n\r\nzz\r\nhi\r\n0\r\n\r\n"  # waitress answers
    with socket.create_connection(("127.0.0.1", server.config.port), timeout=5) as raw:
        raw.sendall(b"POST /api/chat HTTP/1.1\r\nHost: x\r\n" + framing)
        answer = b"".join(iter(lambda: raw.recv(65536), b"")).decode()  # until it closes
    head, _, body = answer.partition("\r\n\r\n")
    assert head.startswith("HTTP/1.1 400") and set(json.loads(body)) == {"error"}
    assert_error(post(server, "/api/pull", {"model": "x"}), 501, "--model")
    assert_error(request(server.url, "DELETE", "/api/delete", {"model": "x"}), 501, "--model")


def test_keys_guard_the_api_routes(fake_server):
    server = fake_server(FakeEngine(token_s=0.0))
    server.runtime.keys.replace({"tool": KEY.encode()})
    for method, path in [("GET", "/api/tags"), ("POST", "/api/chat"), ("GET", "/api/version")]:
        reply = request(server.url, method, path, {"model": "m", "messages": ASK})
        assert_error(reply, 401, "API key")
        assert reply.headers["www-authenticate"].startswith("Bearer")
    good = ollama.Client(host=server.url, headers={"Authorization": f"Bearer {KEY}"})
    assert good.chat(model="m", messages=ASK, options={"num_predict": 2}).done
    guessing = ollama.Client(host=server.url, headers={"Authorization": "Bearer " + "g" * 20})
    statuses = []
    for _ in range(11):
        with pytest.raises(ollama.ResponseError) as refused:
            guessing.list()
        statuses.append(refused.value.status_code)
    assert statuses == [401] * 10 + [429]
    reply = request(server.url, "GET", "/api/tags", headers={"Authorization": "Bearer x" * 3})
    assert_error(reply, 429, "too many")
    assert int(reply.headers["retry-after"]) >= 1


def test_a_full_queue_is_a_503_the_client_reports(fake_server):
    server = fake_server(FakeEngine(token_s=0.05), "--max-queue", "1")
    streams = fill_queue(server)
    try:
        with pytest.raises(ollama.ResponseError) as refused:
            ollama.Client(host=server.url).chat(model="m", messages=ASK)
        assert refused.value.status_code == 503 and "queue" in refused.value.error
        reply = chat(server)
        assert_error(reply, 503, "queue")
        assert float(reply.headers["retry-after"]) >= 1
    finally:
        server.worker.stop()
        for s in streams:
            s.close()


def test_a_client_that_leaves_cancels_its_job(fake_server):
    engine = FakeEngine(token_s=0.02)
    server = fake_server(engine)
    client = ollama.Client(host=server.url)
    parts = client.chat(model="m", messages=ASK, options={"num_predict": 100_000}, stream=True)
    next(parts)
    parts.close()  # the client hangs up
    assert wait_until(lambda: engine.tokens_made, 1)  # uncancelled: 1,024 tokens, 20 s
    assert engine.tokens_made[0] < 40 and not server.worker.busy


def test_an_error_after_the_stream_began_is_its_last_line(fake_server):
    server = fake_server(FakeEngine(token_s=0.02), "--request-timeout", "0.5")
    reply = post(server, "/api/chat", {"model": "m", "messages": ASK})
    parts = lines(reply)
    assert reply.status == 200 and parts[0]["message"]["content"]
    assert set(parts[-1]) == {"error"} and "deadline" in parts[-1]["error"]
    client = ollama.Client(host=server.url)
    with pytest.raises(ollama.ResponseError, match="deadline"):
        list(client.chat(model="m", messages=ASK, stream=True))


def test_tags_show_ps_and_version(fake_server):
    server = fake_server(FakeEngine(token_s=0.0))
    [listed] = request(server.url, "GET", "/api/tags").json()["models"]
    assert listed["name"] == listed["model"] == "fake"
    shown = post(server, "/api/show", {"model": "fake:latest"}).json()
    assert shown["capabilities"] == ["completion"]  # no grammar compiler: no tools
    assert_error(post(server, "/api/show", {"model": "llama3"}), 404, "llama3", "fake")
    [running] = request(server.url, "GET", "/api/ps").json()["models"]
    assert running["context_length"] == server.runtime.prompts.context_tokens
    assert request(server.url, "GET", "/api/version").json()["version"]


def test_before_the_model_is_loaded_the_routes_answer_503(fake_server):
    server = fake_server(None, ready=False)
    for method, path in [("GET", "/api/tags"), ("GET", "/api/ps"), ("POST", "/api/chat")]:
        reply = request(server.url, method, path, {"model": "m", "messages": ASK})
        assert_error(reply, 503, "loading")
        assert reply.headers["retry-after"]


def test_the_routes_are_counted_by_their_rule(fake_server):
    server = fake_server(FakeEngine(token_s=0.0))
    chat(server)
    request(server.url, "GET", "/api/tags")
    post(server, "/api/chat", {"messages": "no"})
    samples = scrape(server.url)
    count = "deskchat_requests_total"
    assert value(samples, count, route="/api/chat", status="200", key="") == 1
    assert value(samples, count, route="/api/chat", status="400", key="") == 1
    assert value(samples, count, route="/api/tags", status="200", key="") == 1


def test_logprobs_come_with_the_text_whole_and_streamed(fake_server):
    server = fake_server(FakeEngine(token_s=0.0, reply=["a", "b"]))
    whole = chat(server, logprobs=True, top_logprobs=2).json()
    assert [e["token"] for e in whole["logprobs"]] == ["a", "b"]
    assert [t["token"] for t in whole["logprobs"][0]["top_logprobs"]] == ["A", "A"]
    streamed = lines(post(server, "/api/chat", {"messages": ASK, "logprobs": True}))
    assert [[e["token"] for e in p["logprobs"]] for p in streamed[:-1]] == [["a"], ["b"]]
    assert_error(chat(server, top_logprobs=2), 400, "top_logprobs")
