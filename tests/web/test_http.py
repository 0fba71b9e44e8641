"""The HTTP contract on a real waitress server, with a scripted engine where timing matters."""

from __future__ import annotations

import json
import socket
import time

import pytest

from tests.support.fakes import FakeEngine
from tests.support.httpclient import chat, request, stream_all, wait_until
from tests.support.traffic import (
    Stream_in_thread,
    fill_batch,
    fill_queue,
    leave_a_plain_request,
    leave_a_stream,
    queue_raw_clients,
    raw_post,
)


def assert_error(reply, status: int, kind: str) -> dict:
    assert reply.status == status, reply.body
    assert reply.headers["content-type"].startswith("application/json")
    error = reply.json()["error"]
    assert error["code"] == status and error["type"] == kind and error["message"]
    assert b"Traceback" not in reply.body and b"<html" not in reply.body.lower()
    return error


BAD_BODIES = [
    pytest.param({}, id="neither message nor messages"),
    pytest.param({"message": "hi", "messages": [{"role": "user", "content": "hi"}]}, id="both"),
    pytest.param({"message": ""}, id="empty message"),
    pytest.param({"message": "   "}, id="blank message"),
    pytest.param({"message": 5}, id="message not a string"),
    pytest.param({"messages": []}, id="empty messages"),
    pytest.param({"messages": "hi"}, id="messages not a list"),
    pytest.param({"messages": [{"role": "robot", "content": "hi"}]}, id="unknown role"),
    pytest.param({"messages": [{"role": "user"}]}, id="missing content"),
    pytest.param(
        {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]},
        id="last not user",
    ),
    pytest.param({"message": "hi", "max_tokens": 0}, id="max_tokens zero"),
    pytest.param({"message": "hi", "max_tokens": "5"}, id="max_tokens string"),
    pytest.param({"message": "hi", "max_tokens": True}, id="max_tokens bool"),
    pytest.param({"message": "hi", "temperature": -1}, id="temperature negative"),
    pytest.param({"message": "hi", "temperature": 9}, id="temperature too high"),
    pytest.param({"message": "hi", "top_p": 0}, id="top_p zero"),
    pytest.param({"message": "hi", "top_p": 1.5}, id="top_p too high"),
    pytest.param({"message": "hi", "stream": "yes"}, id="stream not bool"),
    pytest.param({"message": "hi", "stop": [1]}, id="stop not strings"),
    pytest.param({"message": "hi", "stop": ["a"] * 9}, id="too many stops"),
    pytest.param({"message": "hi", "system": ""}, id="empty system"),
    pytest.param({"message": "hi", "mesage": "typo"}, id="unknown field"),
    pytest.param([1, 2], id="not an object"),
    pytest.param({"message": "\ud800"}, id="lone surrogate"),
    pytest.param({"message": "hi", "stop": ["\udfff"]}, id="surrogate stop"),
]


@pytest.mark.parametrize("body", BAD_BODIES)
def test_invalid_requests_are_400(fake_server, body):
    server = fake_server()
    assert_error(chat(server.url, body), 400, "invalid_request")
    assert server.engine.ran == []


@pytest.mark.parametrize(
    "raw",
    [
        pytest.param(b"{not json", id="not json"),
        pytest.param(b'{"message": "hi", "temperature": NaN}', id="NaN"),
        pytest.param(b'{"message": "hi", "top_p": Infinity}', id="Infinity"),
        pytest.param(b"[" * 30000 + b"]" * 30000, id="deep nesting"),
        pytest.param(b'{"message": "hi", "max_tokens": ' + b"9" * 5000 + b"}", id="huge integer"),
        pytest.param(b'{"message": "\xff\xfe"}', id="not utf-8"),
    ],
)
def test_malformed_json_is_400(fake_server, raw):
    server = fake_server()
    assert_error(request(server.url, "POST", "/chat", raw=raw), 400, "invalid_request")
    assert server.engine.ran == []


def test_options_is_405_json(fake_server):
    assert_error(request(fake_server().url, "OPTIONS", "/chat"), 405, "method_not_allowed")


def test_404_does_not_echo_a_huge_path(fake_server):
    reply = request(fake_server().url, "GET", "/" + "a" * 20000)
    assert_error(reply, 404, "not_found")
    assert len(reply.body) < 500


def test_what_an_error_echoes_of_a_request_is_bounded(fake_server):
    """Found by fuzzing: every unknown field's whole name, and a 1,000-letter method, came
    back in the error message."""
    server = fake_server()
    many = {f"{'k' * 500}{i}": 1 for i in range(100)}
    reply = chat(server.url, {"message": "hi", **many})
    message = assert_error(reply, 400, "invalid_request")["message"]
    assert len(message) < 400 and "and 95 more" in message, message
    head, body = raw_exchange(server.url, b"X" * 1000 + b" /chat HTTP/1.1\r\nHost: x\r\n\r\n")
    assert b" 405 " in head.split(b"\r\n")[0] and len(body) < 400, (head, body)


FORGING = "%0a2026-01-01%2000:00:00,000%20ERROR%20deskchat.http:%20FORGED"


@pytest.mark.parametrize("control", ["%0a", "%0d", "%1b[2J", "%e2%80%a8"])
def test_a_path_cannot_write_a_log_line_of_its_own(fake_server, caplog, control):
    """Issue 62: the logged route is the decoded path, with control characters escaped."""
    server = fake_server()
    caplog.set_level("INFO", logger="deskchat.http")
    path = f"/api/chat{control}{FORGING}"
    reply = request(server.url, "POST", path, {"messages": [{"role": "user", "content": "x"}]})
    assert reply.status == 404 and "no such endpoint" in reply.json()["error"]
    [line] = [r.getMessage() for r in caplog.records if "route=/api/chat" in r.getMessage()]
    assert not any(c in line for c in "\n\r\x1b\u2028"), line
    assert "\\x" in line or "\\u2028" in line
    assert " ERROR deskchat.http: FORGED" in line  # kept, inside the one line, readable


def raw_exchange(url: str, data: bytes) -> tuple[bytes, bytes]:
    """Send raw bytes, read until the server closes; (head, body)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(data)
        reply = b"".join(iter(lambda: sock.recv(65536), b""))
    head, _, body = reply.partition(b"\r\n\r\n")
    return head, body


def test_body_over_waitress_own_limit_is_413_json(fake_server):
    server = fake_server(None, "--max-body-bytes", "1024")
    head, body = raw_exchange(
        server.url, b"POST /chat HTTP/1.1\r\nHost: x\r\nContent-Length: 5000000\r\n\r\n{"
    )
    assert head.startswith(b"HTTP/1.1 413") and b"application/json" in head
    assert json.loads(body)["error"]["type"] == "too_large"


def test_what_waitress_refuses_on_v1_is_in_openai_shape(fake_server):
    server = fake_server(None, "--max-body-bytes", "1024")
    head, body = raw_exchange(
        server.url,
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5000000\r\n\r\n{",
    )
    assert head.startswith(b"HTTP/1.1 413")
    error = json.loads(body)["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "too_large"
    assert "param" in error and error["message"]


def test_malformed_http_is_400_json(fake_server):
    head, body = raw_exchange(
        fake_server().url, b"POST /chat HTTP/1.1\r\nHost: x\r\nContent-Length: nope\r\n\r\n"
    )
    assert head.startswith(b"HTTP/1.1 400") and b"application/json" in head
    assert json.loads(body)["error"]["type"] == "invalid_request"


def test_unknown_path_is_404_json(fake_server):
    assert_error(request(fake_server().url, "GET", "/nowhere"), 404, "not_found")


def test_wrong_method_is_405_json(fake_server):
    reply = request(fake_server().url, "GET", "/chat")
    assert_error(reply, 405, "method_not_allowed")
    assert "POST" in reply.headers["allow"]


def test_body_over_limit_is_413(fake_server):
    server = fake_server(None, "--max-body-bytes", "1024")
    reply = chat(server.url, {"message": "x" * 2000})
    assert_error(reply, 413, "too_large")
    assert server.engine.ran == []


def test_prompt_over_context_is_413_with_token_counts(fake_server):
    server = fake_server()  # the fake's context is 4096 tokens, one id per character
    error = assert_error(chat(server.url, {"message": "y" * 5000}), 413, "too_large")
    assert "5000" in error["message"] and "4095" in error["message"]


def test_loading_is_503_until_ready(fake_server):
    server = fake_server(None, ready=False)
    assert_error(chat(server.url, {"message": "hi"}), 503, "loading")
    health = request(server.url, "GET", "/health")
    assert health.status == 503 and health.json()["status"] == "loading"


def test_health_reports_model_and_queue(fake_server):
    server = fake_server(None, "--max-queue", "3")
    body = request(server.url, "GET", "/health").json()
    assert body["status"] == "ok" and body["model"] == "fake"
    assert body["queue"] == {"depth": 0, "capacity": 3}


def test_answer_shape(fake_server):
    server = fake_server(FakeEngine(token_s=0.001))
    reply = chat(server.url, {"message": "hello", "max_tokens": 3})
    assert reply.status == 200
    body = reply.json()
    assert body["response"] == "w1 w2 w3 "
    assert body["model"] == "fake" and body["id"] == reply.headers["x-request-id"]
    assert body["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 3}
    assert set(body["timings"]) == {
        "queued_ms",
        "ttft_ms",
        "total_ms",
        "tokens_per_second",
        "draft_tokens",
        "drafted_tokens",
        "decode_steps",
    }


def test_max_tokens_is_capped_by_the_server(fake_server):
    server = fake_server(FakeEngine(token_s=0.0), "--max-tokens-cap", "4")
    body = chat(server.url, {"message": "hello", "max_tokens": 50}).json()
    assert body["usage"]["completion_tokens"] == 4


def test_stream_shape(fake_server):
    server = fake_server(FakeEngine(token_s=0.001))
    text, events = stream_all(server.url, {"message": "hello", "max_tokens": 3})
    assert text == "w1 w2 w3 "
    *deltas, (name, done) = events
    assert all(n == "message" and set(d) == {"id", "delta"} for n, d in deltas)
    assert done["done"] is True and done["finish_reason"] == "length"
    assert len({d["id"] for _, d in events}) == 1


def test_generation_failure_is_500_and_service_goes_on(fake_server):
    server = fake_server(FakeEngine(token_s=0.001, fail_on="boom"))
    error = assert_error(chat(server.url, {"message": "boom"}), 500, "internal")
    assert "chat-" in error["message"]
    assert chat(server.url, {"message": "fine", "max_tokens": 2}).status == 200


def test_full_queue_is_503_with_retry_after_at_once(fake_server):
    server = fake_server(FakeEngine(token_s=0.05), "--max-queue", "2")
    streams = fill_queue(server)
    started = time.monotonic()
    reply = chat(server.url, {"message": "one too many"})
    assert time.monotonic() - started < 1.0
    assert_error(reply, 503, "overloaded")
    assert float(reply.headers["retry-after"]) > 0
    server.worker.stop()
    for s in streams:
        s.close()


def test_health_answers_fast_while_busy_and_full(fake_server):
    server = fake_server(FakeEngine(token_s=0.05), "--max-queue", "2")
    streams = fill_queue(server)
    for _ in range(5):
        started = time.monotonic()
        reply = request(server.url, "GET", "/health", timeout=5)
        assert time.monotonic() - started < 0.5
        body = reply.json()
        assert body["busy"] is True and body["queue"] == {"depth": 2, "capacity": 2}
    server.worker.stop()
    for s in streams:
        s.close()


def test_deadline_in_queue_is_504(fake_server):
    # The running job is in a long prefill that no flag can interrupt; the next one expires.
    server = fake_server(FakeEngine(token_s=0.02, prefill_s=1.5), "--request-timeout", "0.5")
    runner = Stream_in_thread(server.url, {"message": "run", "max_tokens": 5})
    assert server.engine.started.wait(5)
    started = time.monotonic()
    assert_error(chat(server.url, {"message": "late"}), 504, "timeout")
    assert time.monotonic() - started < 3
    runner.close()
    assert [ord(c) for c in "late"] not in server.engine.ran


def test_deadline_during_stream_is_an_error_event(fake_server):
    server = fake_server(FakeEngine(token_s=0.02), "--request-timeout", "0.5")
    _, events = stream_all(server.url, {"message": "long", "max_tokens": 100_000})
    name, last = events[-1]
    assert name == "error" and last["error"]["code"] == 504
    assert events[0][1].get("delta")


@pytest.mark.parametrize("leave", [leave_a_stream, leave_a_plain_request])
def test_client_leaving_stops_its_running_job(fake_server, leave):
    server = fake_server(FakeEngine(token_s=0.02))
    leave(server)
    assert wait_until(lambda: not server.worker.busy, 1.0)  # uncancelled: 1024 tokens, 20 s
    assert server.engine.tokens_made[-1] < 40


def test_client_leaving_while_queued_drops_the_job(fake_server):
    server = fake_server(FakeEngine(token_s=0.02))
    runners = fill_batch(server, max_tokens=50)
    sock = raw_post(server.url, {"message": "gone"})
    assert wait_until(lambda: server.worker.depth == 1, 2)
    sock.close()
    for runner in runners:
        list(runner.events())
        runner.close()
    assert wait_until(lambda: not server.worker.busy and server.worker.depth == 0, 3)
    assert [ord(c) for c in "gone"] not in server.engine.ran


def test_clients_that_left_the_queue_never_cause_a_503(fake_server):
    server = fake_server(FakeEngine(token_s=0.02), "--max-queue", "2")
    runners = fill_batch(server, max_tokens=40)
    socks = queue_raw_clients(server, ["gone0", "gone1"])
    for sock in socks:
        sock.close()
    assert wait_until(lambda: server.worker.depth == 0, 1)  # at once, not after the batch
    assert server.worker.running == server.worker.max_batch
    newcomers = [Stream_in_thread(server.url, {"message": f"new{i}"}) for i in range(2)]
    assert wait_until(lambda: server.worker.depth == 2, 2)
    for runner in runners:
        list(runner.events())
        runner.close()
    for c in newcomers:
        c.close()
        assert c.stream.status == 200
    assert all([ord(c) for c in f"gone{i}"] not in server.engine.ran for i in range(2))


def test_expired_queued_requests_never_cause_a_503(fake_server):
    # The running job is in a long prefill; the two queued ones pass their deadline (504).
    server = fake_server(
        FakeEngine(token_s=0.01, prefill_s=2.5), "--max-queue", "2", "--request-timeout", "1"
    )
    runner = Stream_in_thread(server.url, {"message": "run", "max_tokens": 5})
    assert server.engine.started.wait(5)
    queued = [Stream_in_thread(server.url, {"message": f"late{i}"}) for i in range(2)]
    for q in queued:
        q.close()
        assert q.stream.status == 504
    health = request(server.url, "GET", "/health").json()
    assert health["busy"] and health["queue"]["depth"] == 0
    reply = chat(server.url, {"message": "next"})  # queued behind the prefill, not refused
    assert_error(reply, 504, "timeout")
    runner.close()


def test_json_without_content_type_is_accepted(fake_server):
    server = fake_server(FakeEngine(token_s=0.0))
    reply = request(
        server.url,
        "POST",
        "/chat",
        raw=b'{"message": "hi", "max_tokens": 1}',
        headers={"Content-Type": "application/x-www-form-urlencoded"},
    )
    assert reply.status == 200 and reply.json()["usage"]["completion_tokens"] == 1


def test_requests_are_answered_in_arrival_order(fake_server):
    # The queue holds more than a batch, so the queued ones start over several admissions.
    server = fake_server(FakeEngine(token_s=0.01), "--max-queue", "6")
    runners = fill_batch(server, max_tokens=1000)
    names = [f"client{i}" for i in range(6)]
    clients = []
    for depth, name in enumerate(names, start=1):
        clients.append(Stream_in_thread(server.url, {"message": name, "max_tokens": 2}))
        assert wait_until(lambda d=depth: server.worker.depth == d, 5)  # arrived, in order
    for c in [*runners, *clients]:
        c.close()
    batch = server.worker.max_batch
    assert wait_until(lambda: len(server.engine.ran) == batch + len(names), 10)
    assert server.engine.ran[batch:] == [[ord(c) for c in name] for name in names]
