"""A loopback stand-in for the ModelScope hub HTTP API, enough for snapshot_download.

It serves the requests modelscope (1.40, via modelscope_hub) makes to download a
model repo, for repos held in memory, and records every request it gets:

- ``GET /api/v1/models/{owner}/{name}/repo/files?Revision=R&Recursive=True``: file listing
- ``GET /api/v1/models/{owner}/{name}/repo?Revision=R&FilePath=P``: one file's bytes
- ``GET /api/v1/models/{owner}/{name}``: repo info
- ``GET /api/v1/repos/internalAccelerationInfo``: answered 404 (no cloud acceleration)
- ``HEAD /`` and anything else: 404 with a JSON error body

Reusable from any test: ``with ModelScopeStandin({"owner/name": {"config.json": b"{}"}}) as hub:``
then pass ``endpoint=hub.url``.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

_REPO = r"/api/v1/models/(?P<repo>[^/]+/[^/]+)"
_FILES = re.compile(_REPO + r"/repo/files$")
_FILE = re.compile(_REPO + r"/repo$")
_INFO = re.compile(_REPO + r"$")


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    query: dict[str, str]


class ModelScopeStandin:
    """Serve ``repos`` ({model_id: {path_in_repo: bytes}}) on 127.0.0.1 at a free port."""

    def __init__(self, repos: dict[str, dict[str, bytes]], revision: str = "master") -> None:
        self.repos = repos
        self.revision = revision
        self.requests: list[Request] = []
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler_class())
        self._server.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> ModelScopeStandin:
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and close the listening socket (the port then refuses connections)."""
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> ModelScopeStandin:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def file_requests(self) -> list[str]:
        """Paths of the repo files that were downloaded, in request order."""
        return [r.query.get("FilePath", "") for r in self.requests if _FILE.match(r.path)]

    # -- HTTP ---------------------------------------------------------------
    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:  # noqa: A002
                pass  # keep pytest output clean; requests are recorded instead

            def do_HEAD(self) -> None:
                hub._handle(self, head=True)

            def do_GET(self) -> None:
                hub._handle(self, head=False)

        return Handler

    def _handle(self, h: BaseHTTPRequestHandler, *, head: bool) -> None:
        parts = urlsplit(h.path)
        query = {k: v[0] for k, v in parse_qs(parts.query).items()}
        with self._lock:
            self.requests.append(Request(h.command, parts.path, query))

        if m := _FILES.match(parts.path):
            files = self._repo(m["repo"], query.get("Revision"))
            if files is None:
                return self._json(h, 404, {"Code": 10010205001, "Message": "not found"}, head)
            listing = [
                {
                    "Name": path.rsplit("/", 1)[-1],
                    "Path": path,
                    "Type": "blob",
                    "Size": len(data),
                    "Sha256": hashlib.sha256(data).hexdigest(),
                    "Revision": self.revision,
                }
                for path, data in sorted(files.items())
            ]
            return self._json(
                h, 200, {"Code": 200, "Data": {"Files": listing}, "Success": True}, head
            )

        if m := _FILE.match(parts.path):
            files = self._repo(m["repo"], query.get("Revision"))
            data = None if files is None else files.get(query.get("FilePath", ""))
            if data is None:
                return self._json(h, 404, {"Code": 10010205001, "Message": "file not found"}, head)
            return self._send(h, 200, data, "application/octet-stream", head)

        if (m := _INFO.match(parts.path)) and m["repo"] in self.repos:
            info = {
                "Code": 200,
                "Data": {"Path": m["repo"].split("/")[0], "Name": m["repo"].split("/")[1]},
                "Success": True,
            }
            return self._json(h, 200, info, head)

        return self._json(h, 404, {"Code": 404, "Message": "not found", "Success": False}, head)

    def _repo(self, repo: str, revision: str | None) -> dict[str, bytes] | None:
        if revision not in (None, self.revision):
            return None
        return self.repos.get(repo)

    def _json(self, h: BaseHTTPRequestHandler, status: int, body: dict, head: bool) -> None:
        self._send(h, status, json.dumps(body).encode(), "application/json", head)

    @staticmethod
    def _send(h: BaseHTTPRequestHandler, status: int, body: bytes, ctype: str, head: bool) -> None:
        h.send_response(status)
        h.send_header("Content-Type", ctype)
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        if not head:
            h.wfile.write(body)
