"""Traffic shapes against a fake-engine server: a full batch and queue, requests queued on raw
sockets, and clients that leave mid-answer."""

from __future__ import annotations

import json
import socket
import threading
import time

from tests.support.httpclient import Stream, wait_until


def fill_batch(server, max_tokens: int = 100_000) -> list[Stream]:
    """Every batch place running a job of `max_tokens` (the first is "run", then "run1"...);
    returns their open streams."""
    streams = [Stream(server.url, {"message": "run", "max_tokens": max_tokens})]
    assert server.engine.started.wait(5)
    for i in range(1, server.worker.max_batch):
        streams.append(Stream(server.url, {"message": f"run{i}", "max_tokens": max_tokens}))
    assert wait_until(lambda: server.worker.running == server.worker.max_batch, 5)
    return streams


def fill_queue(server, max_tokens: int = 100_000):
    """The batch full of long jobs and the queue full behind it; returns the open streams."""
    streams: list = fill_batch(server, max_tokens)
    for i in range(server.config.max_queue):
        streams.append(Stream_in_thread(server.url, {"message": f"wait{i}"}))
    assert wait_until(lambda: server.worker.depth == server.config.max_queue, 5)
    return streams


class Stream_in_thread:  # noqa: N801 - a queued request blocks until served, so open it aside
    def __init__(self, url, body):
        self.stream = None
        self.thread = threading.Thread(target=self._open, args=(url, body), daemon=True)
        self.thread.start()

    def _open(self, url, body):
        self.stream = Stream(url, body)

    def close(self):
        self.thread.join(10)
        if self.stream:
            self.stream.close()


def raw_post(url: str, body: dict) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    data = json.dumps(body).encode()
    sock.sendall(
        b"POST /chat HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(data), data)
    )
    return sock


def queue_raw_clients(server, names: list[str]) -> list[socket.socket]:
    """Behind the job running now, one queued request per name on a raw socket to close."""
    socks = [raw_post(server.url, {"message": name}) for name in names]
    assert wait_until(lambda: server.worker.depth == len(names), 5)
    return socks


def leave_a_stream(server) -> None:
    stream = Stream(server.url, {"message": "long", "max_tokens": 100_000})
    events = stream.events()
    for _ in range(3):
        next(events)
    stream.close()


def leave_a_plain_request(server) -> None:
    sock = raw_post(server.url, {"message": "long", "max_tokens": 100_000})
    assert server.engine.started.wait(5)
    time.sleep(0.2)
    sock.close()
