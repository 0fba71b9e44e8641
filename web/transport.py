"""waitress wiring: the HTTP server around the Flask app, with waitress' own errors (bad
request lines, over-size bodies and headers) answered in the same JSON shape as the app's.
"""

from __future__ import annotations

import contextlib
import json
import threading

from waitress.channel import HTTPChannel
from waitress.server import create_server
from waitress.task import ErrorTask

from inference.config import Config


class JsonErrorTask(ErrorTask):
    """waitress answers malformed requests itself, before Flask; in text/plain by default."""

    def execute(self):
        error = self.request.error
        kind = (
            "too_large"
            if error.code in (413, 431)
            else ("invalid_request" if error.code < 500 else "internal")
        )
        message = error.reason if error.code >= 500 else f"{error.reason}: {error.body}"
        body = json.dumps({"error": {"message": message, "type": kind, "code": error.code}})
        self.status = f"{error.code} {error.reason}"
        self.response_headers.append(("Content-Type", "application/json"))
        self.set_close_on_finish()
        self.content_length = len(body)
        self.write(body.encode())


class JsonErrorChannel(HTTPChannel):
    error_task_class = JsonErrorTask


def make_http_server(config: Config, app):
    """The waitress server for `app`; bound at once, served by start_http_thread()."""
    server = create_server(
        app,
        host=config.host,
        port=config.port,
        threads=config.waitress_threads,
        channel_request_lookahead=1,  # gives handlers environ["waitress.client_disconnected"]
        # waitress refuses over-size bodies before Flask sees them; a roomier bound than the
        # app's keeps the app's own 413 the usual one while memory stays bounded.
        max_request_body_size=max(1 << 20, 16 * config.max_body_bytes),
        ident="deskchat",
        # waitress would drop X-Forwarded-For from every peer; the app believes it only from
        # the proxies in --trusted-proxies (web/proxy.py).
        clear_untrusted_proxy_headers=False,
    )
    server.channel_class = JsonErrorChannel
    return server


def start_http_thread(server) -> threading.Thread:
    """Serve in a daemon thread; closing the server from elsewhere ends it quietly."""

    def run() -> None:
        # waitress' select() fails on the sockets that server.close() shut: that is the end.
        with contextlib.suppress(OSError):
            server.run()

    thread = threading.Thread(target=run, name="http", daemon=True)
    thread.start()
    return thread
