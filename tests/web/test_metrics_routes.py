"""Issue 28: every route counts in deskchat_requests_total, the chat page and its files
(sent as files, whose responses werkzeug never closes) included."""

from __future__ import annotations

import time

from tests.support.fakes import FakeEngine
from tests.support.httpclient import request


def counts(server) -> dict[str, float]:
    body = request(server.url, "GET", "/metrics").body.decode()
    lines = [line for line in body.splitlines() if line.startswith("deskchat_requests_total{")]
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in lines}


def test_the_page_and_its_assets_are_counted(fake_server):
    server = fake_server(FakeEngine())
    for path in ("/", "/assets/chat.js", "/assets/chat.css", "/assets/none.js", "/health"):
        request(server.url, "GET", path)
    etag = request(server.url, "GET", "/assets/chat.js").headers["etag"]
    assert (
        request(server.url, "GET", "/assets/chat.js", headers={"If-None-Match": etag}).status == 304
    )
    time.sleep(0.2)  # a response is counted when it closes
    seen = counts(server)
    assets = 'route="/assets/<path:filename>"'
    assert seen['deskchat_requests_total{key="",route="/",status="200"}'] == 1
    assert seen[f'deskchat_requests_total{{key="",{assets},status="200"}}'] == 3
    assert seen[f'deskchat_requests_total{{key="",{assets},status="304"}}'] == 1
    assert seen[f'deskchat_requests_total{{key="",{assets},status="404"}}'] == 1
    assert seen['deskchat_requests_total{key="",route="/health",status="200"}'] == 1
