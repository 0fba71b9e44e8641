"""A small stdlib HTTP client for the tests: JSON posts and SSE streams on loopback."""

from __future__ import annotations

import http.client
import json
import socket
import time
import urllib.parse


class Reply:
    def __init__(self, status: int, headers: dict, body: bytes):
        self.status = status
        self.headers = headers
        self.body = body

    def json(self):
        return json.loads(self.body)


def request(
    base: str,
    method: str,
    path: str,
    body=None,
    raw: bytes | None = None,
    headers: dict | None = None,
    timeout: float = 60,
) -> Reply:
    url = urllib.parse.urlsplit(base)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=timeout)
    try:
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        hdrs = {"Content-Type": "application/json", **(headers or {})}
        conn.request(method, path, body=data, headers=hdrs)
        resp = conn.getresponse()
        return Reply(resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read())
    finally:
        conn.close()


def chat(base: str, body: dict, timeout: float = 120) -> Reply:
    return request(base, "POST", "/chat", body, timeout=timeout)


class Stream:
    """An open SSE response: iterate events as (event_name, data_dict); close() hangs up."""

    def __init__(
        self,
        base: str,
        body: dict,
        timeout: float = 120,
        path: str = "/chat",
        headers: dict | None = None,
    ):
        url = urllib.parse.urlsplit(base)
        self.conn = http.client.HTTPConnection(url.hostname, url.port, timeout=timeout)
        self.conn.request(
            "POST",
            path,
            body=json.dumps({**body, "stream": True}),
            headers={"Content-Type": "application/json", **(headers or {})},
        )
        self.response = self.conn.getresponse()
        self.status = self.response.status

    def events(self):
        name = "message"
        for raw in self.response:
            line = raw.decode().rstrip("\n")
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data = line[6:]
                yield name, data if data == "[DONE]" else json.loads(data)
                name = "message"

    def close(self):
        """Hang up for real: the response's file object holds the socket open otherwise."""
        if self.conn.sock is not None:
            self.conn.sock.shutdown(socket.SHUT_RDWR)
        self.response.close()
        self.conn.close()


def stream_all(base: str, body: dict) -> tuple[str, list[tuple[str, dict]]]:
    s = Stream(base, body)
    try:
        events = list(s.events())
    finally:
        s.close()
    text = "".join(d.get("delta", "") for _, d in events)
    return text, events


def wait_until(predicate, timeout: float, interval: float = 0.05) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()
