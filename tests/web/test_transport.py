"""HTTP at the edges, where waitress answers before Flask: framing, versions, requests that
never finish arriving, and many idle connections. Raw bytes on a loopback socket."""

from __future__ import annotations

import json
import select
import socket
import time

import pytest

from tests.support.fakes import FakeEngine
from tests.support.httpclient import chat, request

READ_TIMEOUT_S = 1  # --http-read-timeout for the tests of incomplete requests


def exchange(url: str, data: bytes, timeout: float = 8) -> tuple[bytes, bytes, float]:
    """Send raw bytes, read until the server closes; (head, body, seconds it took)."""
    host, port = url.removeprefix("http://").split(":")
    started = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        sock.sendall(data)
        chunks = []
        try:
            while chunk := sock.recv(65536):
                chunks.append(chunk)
        except TimeoutError:
            pytest.fail(f"no answer within {timeout} s; got {b''.join(chunks)!r}")
    head, _, body = b"".join(chunks).partition(b"\r\n\r\n")
    return head, body, time.monotonic() - started


def assert_json_error(head: bytes, body: bytes, status: int, kind: str) -> str:
    assert head.startswith(b"HTTP/1.") and head.split(b" ")[1] == str(status).encode(), head
    assert b"content-type: application/json" in head.lower()
    error = json.loads(body)["error"]
    assert error["code"] == status and error["type"] == kind and error["message"]
    return error["message"]


def post(headers: bytes, body: bytes = b"", version: bytes = b"HTTP/1.1") -> bytes:
    return b"POST /chat " + version + b"\r\nHost: x\r\n" + headers + b"\r\n" + body


CHAT = b'{"message": "hi", "max_tokens": 2}'

REFUSED = [
    pytest.param(post(b"Transfer-Encoding: gzip\r\n", CHAT), 501, "not_implemented", id="te gzip"),
    pytest.param(
        post(b"Transfer-Encoding: chunked, gzip\r\n", b"0\r\n\r\n"),
        501,
        "not_implemented",
        id="te chunked then gzip",
    ),
    pytest.param(
        post(b"Transfer-Encoding: chunked\r\nContent-Length: 4\r\n", b"0\r\n\r\n"),
        400,
        "invalid_request",
        id="te and content-length",
    ),
    pytest.param(
        post(b"Content-Length: 4\r\nTransfer-Encoding: chunked\r\n", b"0\r\n\r\n"),
        400,
        "invalid_request",
        id="content-length and te",
    ),
    pytest.param(
        post(b"Transfer-Encoding: chunked\r\nContent-Length: 35\r\n", CHAT, b"HTTP/1.0"),
        400,
        "invalid_request",
        id="te in http/1.0",
    ),
    pytest.param(
        b"GET /health HTTP/9.9\r\nHost: x\r\n\r\n", 505, "http_version_not_supported", id="9.9"
    ),
    pytest.param(
        b"GET /health HTTP/2.0\r\nHost: x\r\n\r\n", 505, "http_version_not_supported", id="2.0"
    ),
    pytest.param(
        b"GET /health HTTP/0.9\r\nHost: x\r\n\r\n", 505, "http_version_not_supported", id="0.9"
    ),
    pytest.param(b"GET /health\r\nHost: x\r\n\r\n", 400, "invalid_request", id="no version"),
    pytest.param(
        post(b"Transfer-Encoding: chunked\r\n", b"zz\r\nhi\r\n0\r\n\r\n"),
        400,
        "invalid_request",
        id="chunk size not hex",
    ),
    pytest.param(
        post(b"Transfer-Encoding: chunked\r\n", b"2\r\nhiXX\r\n0\r\n\r\n"),
        400,
        "invalid_request",
        id="chunk longer than its size",
    ),
    pytest.param(
        post(b"Transfer-Encoding: chunked\r\n", b"2;\x01\r\nhi\r\n0\r\n\r\n"),
        400,
        "invalid_request",
        id="bad chunk extension",
    ),
]


@pytest.mark.parametrize(("data", "status", "kind"), REFUSED)
def test_refused_framing_and_versions_get_a_json_error_at_once(fake_server, data, status, kind):
    server = fake_server(FakeEngine(token_s=0.0))
    head, body, took = exchange(server.url, data)
    assert_json_error(head, body, status, kind)
    assert took < 2
    assert server.engine.ran == []


INCOMPLETE = [
    pytest.param(
        post(b"Transfer-Encoding: chunked\r\n", b"10\r\nhi\r\n0\r\n\r\n"),
        id="chunk shorter than its size",
    ),
    pytest.param(post(b"Transfer-Encoding: chunked\r\n", b"2\r\nhi\r\n"), id="no last chunk"),
    pytest.param(
        post(b"Transfer-Encoding: chunked\r\n", b"2\r\nhi\r\n0\r\nX-Trailer: 1\r\n"),
        id="trailer never ends",
    ),
    pytest.param(post(b"Content-Length: 100\r\n", CHAT), id="body shorter than content-length"),
    pytest.param(b"POST /chat HTTP/1.1\r\nHost: x\r\n", id="headers never end"),
]


@pytest.mark.parametrize("data", INCOMPLETE)
def test_a_request_that_never_completes_is_answered_408(fake_server, data):
    server = fake_server(FakeEngine(token_s=0.0), "--http-read-timeout", str(READ_TIMEOUT_S))
    head, body, took = exchange(server.url, data)
    assert "did not arrive in full" in assert_json_error(head, body, 408, "timeout")
    assert READ_TIMEOUT_S <= took < READ_TIMEOUT_S + 3
    assert server.engine.ran == []


def test_a_request_trickled_byte_by_byte_is_cut_at_the_read_timeout(fake_server):
    server = fake_server(FakeEngine(token_s=0.0), "--http-read-timeout", str(READ_TIMEOUT_S))
    host, port = server.url.removeprefix("http://").split(":")
    data = post(b"Content-Length: 35\r\n", CHAT)  # 4 s at one byte per 50 ms
    started = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=8) as sock:
        for byte in data:  # never idle for long, but slower than the read timeout allows
            if select.select([sock], [], [], 0)[0]:
                assert b" 408 " in sock.recv(65536).split(b"\r\n")[0]
                break
            try:
                sock.sendall(bytes([byte]))
            except OSError:  # closed by the server: its answer was lost in the reset
                break
            time.sleep(0.05)
        else:
            pytest.fail("the trickled request was taken in full")
    assert time.monotonic() - started < READ_TIMEOUT_S + 2.5


def test_chunked_bodies_still_work(fake_server):
    server = fake_server(FakeEngine(token_s=0.0))
    chunked = b"".join(b"%x\r\n%s\r\n" % (len(part), part) for part in (CHAT[:10], CHAT[10:]))
    head, body, _ = exchange(
        server.url,
        post(b"Transfer-Encoding: chunked\r\nConnection: close\r\n", chunked + b"0\r\n\r\n"),
    )
    assert head.startswith(b"HTTP/1.1 200"), head
    assert json.loads(body)["usage"]["completion_tokens"] == 2


def test_an_idle_connection_is_closed_after_the_idle_timeout(fake_server):
    server = fake_server(FakeEngine(token_s=0.0), "--http-idle-timeout", "1")
    host, port = server.url.removeprefix("http://").split(":")
    started = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=8) as sock:
        assert sock.recv(1) == b""  # closed, without an answer: no request was begun
    assert 1 <= time.monotonic() - started < 4


def test_hundreds_of_idle_connections_lock_nobody_out(fake_server):
    server = fake_server(FakeEngine(token_s=0.0))
    host, port = server.url.removeprefix("http://").split(":")
    idle = []
    try:
        for i in range(300):  # waitress' own default limit was 100 connections
            sock = socket.create_connection((host, int(port)), timeout=5)
            if i % 2:
                sock.sendall(b"POST /chat HTTP/1.1\r\n")  # begun, never finished
            idle.append(sock)
        assert server.worker.alive
        health = request(server.url, "GET", "/health", timeout=5)
        assert health.status == 200
        reply = chat(server.url, {"message": "hi", "max_tokens": 2}, timeout=5)
        assert reply.status == 200 and reply.json()["usage"]["completion_tokens"] == 2
    finally:
        for sock in idle:
            sock.close()


def test_closing_waits_for_the_request_threads(fake_server, caplog):
    """The server closed while a request thread still answers: the threads finish first
    (closing first took away the trigger a finishing thread wakes the loop with: CI logged
    its 'Bad file descriptor' traceback in a later test)."""
    server = fake_server(FakeEngine(token_s=0.05))
    host, port = server.url.removeprefix("http://").split(":")
    body = json.dumps({"message": "hi", "max_tokens": 10}).encode()
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(
            b"POST /chat HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        time.sleep(0.15)  # the answer is being made (10 tokens, 0.5 s)
        started = time.monotonic()
        server.server.close()
        assert server.server.task_dispatcher.threads == set()  # the answering one too
        assert time.monotonic() - started < 3  # it waited for the answer, no longer
    assert not [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")]


def test_a_client_gone_before_its_refusal_is_answered_leaves_no_traceback(fake_server, caplog):
    """A header waitress refuses (a bare CR in it), the connection closed at once: writing
    the refusal fails, and waitress names the request's path, which a request refused
    before its request line was read did not have (an AttributeError, found by fuzzing)."""
    server = fake_server()
    host, port = server.url.removeprefix("http://").split(":")
    for _ in range(30):
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Request-Id: a\rb\r\n\r\n")
    time.sleep(0.5)
    assert request(server.url, "GET", "/health").status == 200
    assert not [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/api/chat", "/chat"])
def test_a_refused_header_is_answered_in_its_paths_dialect(fake_server, path):
    """waitress refuses a malformed header line before it reads the request line into a
    path: the path is read from the line itself (found by fuzzing: /v1 and /api answered in
    /chat's shape)."""
    server = fake_server()
    data = f"POST {path} HTTP/1.1\r\nHost: x\r\nBad Header\r\nContent-Length: 2\r\n\r\n{{}}"
    head, body, _ = exchange(server.url, data.encode())
    assert head.split(b" ")[1] == b"400", head
    error = json.loads(body)["error"]
    if path.startswith("/api/"):
        assert isinstance(error, str) and error
    elif path.startswith("/v1/"):
        assert error["code"] == "invalid_request" and "param" in error
    else:
        assert error["code"] == 400 and error["type"] == "invalid_request"
