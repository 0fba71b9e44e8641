"""Issue 28: past --connection-limit a health check is still answered at once. A few more
connections are taken for `GET /health` only (then closed); anything else on them gets a
quick 503, and past that reserve too new connections wait in the backlog as before."""

from __future__ import annotations

import socket
import time

from tests.support.fakes import FakeEngine
from tests.support.httpclient import request
from tests.support.metrics import scrape, value
from web.transport import HEALTH_RESERVE, RESERVE_TIMEOUT_S

LIMIT = 4


def idle_connections(server, count: int) -> list[socket.socket]:
    port = int(server.url.rsplit(":", 1)[1])
    sockets = [socket.create_connection(("127.0.0.1", port)) for _ in range(count)]
    time.sleep(0.5)  # accepted by the server's loop
    return sockets


def timed(server, method: str, path: str, body=None):
    began = time.monotonic()
    reply = request(server.url, method, path, body, timeout=10)
    return reply, time.monotonic() - began


def test_health_is_answered_at_once_while_the_limit_is_full(fake_server):
    server = fake_server(FakeEngine(), "--connection-limit", str(LIMIT))
    held = idle_connections(server, LIMIT + 1)
    try:
        reply, took = timed(server, "GET", "/health")
        assert reply.status == 200 and took < 2, (reply.status, took)
        assert reply.headers.get("connection") == "close"
        chat, took = timed(server, "POST", "/chat", {"message": "hi", "max_tokens": 2})
        assert chat.status == 503 and took < 2, (chat.status, took, chat.body)
        assert chat.json()["error"]["type"] == "overloaded" and "retry-after" in chat.headers
        # A connection held before the limit was reached is served as ever.
        held[0].sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert held[0].recv(100).startswith(b"HTTP/1.1 200")
    finally:
        for s in held:
            s.close()
    time.sleep(0.5)  # the held connections are closed: /metrics gets a connection of its own
    samples = scrape(server.url)  # the 503 the client got is counted (issue 34)
    assert value(samples, "deskchat_requests_total", route="/chat", status="503", key="") == 1
    assert value(samples, "deskchat_rejections_total", reason="overloaded") == 1


def test_the_reserve_does_not_keep_idle_connections(fake_server):
    server = fake_server(FakeEngine(), "--connection-limit", str(LIMIT))
    held = idle_connections(server, LIMIT + HEALTH_RESERVE)  # the limit and the reserve full
    try:
        time.sleep(RESERVE_TIMEOUT_S + 1.5)  # the reserve's idle ones are closed by now
        reply, took = timed(server, "GET", "/health")
        assert reply.status == 200 and took < 2, (reply.status, took)
    finally:
        for s in held:
            s.close()
