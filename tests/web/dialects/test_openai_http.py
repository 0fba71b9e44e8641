"""The OpenAI dialect's HTTP contract on a real waitress server with the scripted engine:
shapes, fields, errors, the exact SSE bytes. The official client runs in test_openai_client.py.
"""

from __future__ import annotations

import json
import socket

import pytest

from tests.support.fakes import FakeEngine
from tests.support.httpclient import Stream, request, wait_until
from tests.support.traffic import fill_queue

PATH = "/v1/chat/completions"
HELLO = [{"role": "user", "content": "hello"}]


def completion(server, body: dict, headers: dict | None = None):
    return request(server.url, "POST", PATH, body, headers=headers)


def assert_openai_error(reply, status: int, code: str, param: str | None = None) -> dict:
    assert reply.status == status, reply.body
    assert reply.headers["content-type"].startswith("application/json")
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code and error["message"] and isinstance(error["type"], str)
    if param is not None:
        assert error["param"] == param, error
    return error


def test_plain_answer_shape(fake_server):
    server = fake_server(FakeEngine(token_s=0.001))
    reply = completion(server, {"model": "anything", "messages": HELLO, "max_tokens": 3})
    assert reply.status == 200, reply.body
    body = reply.json()
    assert body["object"] == "chat.completion" and body["model"] == "fake"
    assert body["id"] == reply.headers["x-request-id"] and isinstance(body["created"], int)
    [choice] = body["choices"]
    assert choice["index"] == 0 and choice["finish_reason"] == "length"
    assert choice["message"] == {"role": "assistant", "content": "w1 w2 w3 "}
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
    assert body["timings"]["tokens_per_second"] >= 0


def test_content_parts_and_developer_role_are_read(fake_server):
    server = fake_server(FakeEngine(token_s=0.0))
    messages = [
        {"role": "developer", "content": "be brief"},
        {
            "role": "user",
            "content": [{"type": "text", "text": "he"}, {"type": "text", "text": "y"}],
        },
    ]
    assert completion(server, {"messages": messages, "max_tokens": 1}).status == 200
    assert server.engine.ran[-1] == [ord(c) for c in "he\ny"]


def test_max_completion_tokens_and_cap(fake_server):
    server = fake_server(FakeEngine(token_s=0.0), "--max-tokens-cap", "4")
    body = completion(server, {"messages": HELLO, "max_completion_tokens": 2}).json()
    assert body["usage"]["completion_tokens"] == 2
    body = completion(server, {"messages": HELLO, "max_tokens": 50}).json()
    assert body["usage"]["completion_tokens"] == 4


NO_OP_FIELDS = {
    "n": 1,
    "frequency_penalty": 0,
    "presence_penalty": 0.0,
    "logprobs": False,
    "response_format": {"type": "text"},
    "user": "tool-7",
    "stream": False,
    "seed": 42,
    "stop": "never",
    "tools": None,
    "parallel_tool_calls": None,
}


def test_no_op_values_of_unimplemented_fields_are_accepted(fake_server):
    server = fake_server(FakeEngine(token_s=0.0))
    reply = completion(server, {"messages": HELLO, "max_tokens": 1, **NO_OP_FIELDS})
    assert reply.status == 200, reply.body


@pytest.mark.parametrize(
    "field, value",
    [
        ("n", 2),
        ("frequency_penalty", 3),  # the sampling fields' ranges: test_sampling_fields.py
        ("top_logprobs", 3),  # without logprobs: true
        ("response_format", {"type": "xml"}),
        ("response_format", {"type": "json_schema", "json_schema": {"name": "x"}}),
        ("tools", {"type": "function"}),  # a list of them
        ("tool_choice", "required"),  # without tools
        ("logit_bias", {"the": -100}),  # token ids only: test_logit_bias_...
        ("user", 5),
        ("stream_options", {"include_usage": True}),  # without stream
        ("max_tokens", 0),
        ("temperature", 10**300),
        ("seed", 2**70),
        ("model", 7),
        ("mesages", HELLO),  # a typo: unknown fields are refused too
    ],
)
def test_unimplemented_values_are_400_naming_the_field(fake_server, field, value):
    server = fake_server(FakeEngine(token_s=0.0))
    reply = completion(server, {"messages": HELLO, field: value})
    error = assert_openai_error(reply, 400, "invalid_request", param=field)
    assert error["type"] == "invalid_request_error"
    assert server.engine.ran == []


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "tool", "content": "x"}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
        [{"role": "user", "content": "hi", "name": "bob"}],
        [{"role": "assistant", "content": "hi"}],
        [],
    ],
    ids=["tool role", "image part", "name", "last not user", "empty"],
)
def test_bad_messages_are_400(fake_server, messages):
    server = fake_server(FakeEngine(token_s=0.0))
    reply = completion(server, {"messages": messages})
    assert assert_openai_error(reply, 400, "invalid_request")["param"].startswith("messages")


def sse_bytes(server, body: dict) -> bytes:
    """The raw response, read until the server closes the connection."""
    host, port = server.url.removeprefix("http://").split(":")
    payload = b'{"messages": [{"role": "user", "content": "hello"}], "stream": true, %s}' % body
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(
            b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (PATH.encode(), len(payload), payload)
        )
        chunks = []
        while data := sock.recv(65536):  # ends only when the server closes
            chunks.append(data)
    return b"".join(chunks)


def dechunk(raw: bytes) -> tuple[bytes, bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    out = b""
    while True:
        size_line, _, body = body.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            return head, out
        out, body = out + body[:size], body[size + 2 :]


def test_stream_bytes_end_with_done_and_the_connection_closes(fake_server):
    server = fake_server(FakeEngine(token_s=0.001))
    head, body = dechunk(sse_bytes(server, b'"max_tokens": 2'))
    assert b"text/event-stream" in head
    frames = body.decode().split("\n\n")
    assert frames[-2:] == ["data: [DONE]", ""]  # [DONE] is the last event
    chunks = [json.loads(f.removeprefix("data: ")) for f in frames[:-2]]
    assert all(c["object"] == "chat.completion.chunk" and "usage" not in c for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == "w1 w2 "
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, None, "length"]
    assert len({c["id"] for c in chunks}) == 1


def test_stream_with_include_usage(fake_server):
    server = fake_server(FakeEngine(token_s=0.001))
    body = {"messages": HELLO, "max_tokens": 2, "stream_options": {"include_usage": True}}
    stream = Stream(server.url, body, path=PATH)
    events = [data for _, data in stream.events()]
    stream.close()
    assert events[-1] == "[DONE]"
    *chunks, usage_chunk = events[:-1]
    assert all(c["usage"] is None for c in chunks)
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"] == {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}


def test_error_after_the_stream_began_is_one_error_event_then_the_end(fake_server):
    server = fake_server(FakeEngine(token_s=0.02), "--request-timeout", "0.5")
    stream = Stream(server.url, {"messages": HELLO, "max_tokens": 100_000}, path=PATH)
    events = [data for _, data in stream.events()]
    stream.close()
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert events[-1]["error"]["code"] == "timeout" and "[DONE]" not in events


@pytest.mark.parametrize("stream", [False, True])
def test_what_langchain_sends_by_default_is_accepted(fake_server, stream):
    server = fake_server(FakeEngine(token_s=0.0))
    body = {"model": "gpt-3.5-turbo", "messages": HELLO, "n": 1, "temperature": 0.7}
    body |= {"stream": stream, "max_tokens": 2}
    if stream:
        body["stream_options"] = {"include_usage": True}
    assert completion(server, body).status == 200


def test_full_queue_is_503_with_short_retry_headers(fake_server):
    server = fake_server(FakeEngine(token_s=0.05), "--max-queue", "1")
    streams = fill_queue(server)
    reply = completion(server, {"messages": HELLO})
    assert_openai_error(reply, 503, "overloaded")
    assert 1 <= int(reply.headers["retry-after"]) <= 60
    # never under a second: the official client reads retry-after-ms first
    assert 1000 <= int(reply.headers["retry-after-ms"]) <= 60_000
    server.worker.stop()
    for s in streams:
        s.close()


def test_abandoned_stream_frees_the_worker(fake_server):
    server = fake_server(FakeEngine(token_s=0.02))
    stream = Stream(server.url, {"messages": HELLO, "max_tokens": 100_000}, path=PATH)
    events = stream.events()
    for _ in range(3):
        next(events)
    stream.close()
    assert wait_until(lambda: not server.worker.busy, 1.0)
    assert server.engine.tokens_made[-1] < 40


def test_models(fake_server):
    server = fake_server(FakeEngine())
    body = request(server.url, "GET", "/v1/models").json()
    assert body["object"] == "list"
    [card] = body["data"]
    assert card["id"] == "fake" and card["object"] == "model" and card["owned_by"]
    assert request(server.url, "GET", "/v1/models/fake").json() == card
    assert_openai_error(request(server.url, "GET", "/v1/models/gpt-4"), 404, "not_found")


@pytest.mark.parametrize(
    "method, path, status, code",
    [
        ("GET", "/v1/nothing", 404, "not_found"),
        ("GET", PATH, 405, "method_not_allowed"),
    ],
)
def test_v1_http_errors_take_the_openai_shape(fake_server, method, path, status, code):
    server = fake_server(FakeEngine())
    assert_openai_error(request(server.url, method, path), status, code)


def test_loading_is_503_in_openai_shape(fake_server):
    server = fake_server(None, ready=False)
    reply = completion(server, {"messages": HELLO})
    assert_openai_error(reply, 503, "loading")
    assert int(reply.headers["retry-after"]) == 5
    assert_openai_error(request(server.url, "GET", "/v1/models"), 503, "loading")
