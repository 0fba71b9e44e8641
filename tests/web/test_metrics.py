"""GET /metrics: real requests against a real server, the scrape read back with
prometheus_client's own parser, every count equal to what was sent; promtool accepts it."""

from __future__ import annotations

import shutil
import subprocess
import threading

import pytest

from inference.host.threads import ThreadGovernor
from tests.support.fakes import FakeEngine
from tests.support.httpclient import Stream, chat, request, wait_until
from tests.support.keys import KEY, OTHER
from tests.support.metrics import scrape, value
from tests.support.servers import free_port
from tests.support.systree import skip_unless_ci
from tests.support.traffic import fill_batch, queue_raw_clients, raw_post

V1 = "/v1/chat/completions"


def series(samples: dict, name: str) -> dict:
    """One metric's samples as {label pairs: value}, zero values left out."""
    return {labels: v for (n, labels), v in samples.items() if n == name and v}


def requests_by(samples: dict) -> dict:
    """deskchat_requests_total as {(route, status, key): count}."""
    out = {}
    for labels, count in series(samples, "deskchat_requests_total").items():
        d = dict(labels)
        out[(d["route"], d["status"], d.get("key", ""))] = count
    return out


def traffic(samples: dict, scraper_key: str = "") -> dict:
    """Request counts without the test's own scrapes."""
    counted = requests_by(samples)
    counted.pop(("/metrics", "200", scraper_key), None)
    return counted


def settled(url: str, expected: dict, key: tuple[str, str] = ("", "")) -> dict:
    """A scrape whose request counts equal `expected`: a request is counted when its
    response closes, a moment after the client has it. Fails with the last counts."""
    name, secret = key
    headers = {"Authorization": f"Bearer {secret}"} if secret else None
    last: dict = {}

    def matches() -> bool:
        nonlocal last
        last = scrape(url, headers)
        return traffic(last, name) == expected

    assert wait_until(matches, 5, interval=0.1), traffic(last, name)
    return last


def test_answers_errors_and_tokens_are_counted(fake_server):
    server = fake_server(FakeEngine(token_s=0.005))
    for _ in range(3):
        assert chat(server.url, {"message": "hi", "max_tokens": 4}).status == 200
    for _ in range(2):
        body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 5}
        stream = Stream(server.url, body, path=V1)
        assert stream.status == 200 and list(stream.events())[-1][1] == "[DONE]"
        stream.close()
    for _ in range(2):
        assert chat(server.url, {"message": ""}).status == 400
    assert request(server.url, "GET", "/nowhere/" + "x" * 50).status == 404
    assert request(server.url, "GET", "/v1/models/some-name").status == 404
    assert request(server.url, "GET", "/health").status == 200

    expected = {
        ("/chat", "200", ""): 3,
        (V1, "200", ""): 2,
        ("/chat", "400", ""): 2,
        ("other", "404", ""): 1,  # never the raw path: label values stay bounded
        ("/v1/models/<path:model_id>", "404", ""): 1,
        ("/health", "200", ""): 1,
    }
    samples = settled(server.url, expected)
    # FakePrompts: one token per character of the last message
    assert value(samples, "deskchat_prompt_tokens_total", key="") == 3 * 2 + 2 * 5
    assert value(samples, "deskchat_completion_tokens_total", key="") == 3 * 4 + 2 * 5
    for name in (
        "deskchat_queue_wait_seconds",
        "deskchat_time_to_first_token_seconds",
        "deskchat_time_per_output_token_seconds",
        "deskchat_request_duration_seconds",
    ):
        assert value(samples, f"{name}_count") == 5, name
        assert value(samples, f"{name}_bucket", le="+Inf") == 5, name
    # the scripted engine reports one token time (5 ms) as its first-token time
    assert value(samples, "deskchat_time_to_first_token_seconds_bucket", le="0.025") == 5
    assert series(samples, "deskchat_rejections_total") == {}
    assert value(samples, "deskchat_timeouts_total") == 0
    assert series(samples, "deskchat_cancellations_total") == {}
    # every rejection reason and cancellation stage is there from the start, at 0
    for reason in ("overloaded", "loading", "unavailable", "unauthorized"):
        assert ("deskchat_rejections_total", (("reason", reason),)) in samples
    for stage in ("queued", "running"):
        assert ("deskchat_cancellations_total", (("stage", stage),)) in samples


def test_state_gauges_model_info_and_process_collectors(fake_server):
    server = fake_server(None, "--max-queue", "3")
    # What an old CPU without an int8 kernel serves for the default int8 (inference/host/cpu.py)
    server.runtime.cpu = {"isa": "older", "paths": {"int8": "none"}, "quantize": "none"}
    samples = scrape(server.url)
    assert value(samples, "deskchat_ready") == 1
    assert value(samples, "deskchat_queue_capacity") == 3
    assert value(samples, "deskchat_queue_depth") == 0
    assert value(samples, "deskchat_running_jobs") == 0
    assert value(samples, "deskchat_inference_threads") == server.config.threads
    # --thread-policy adaptive, after one thread measured faster
    server.runtime.thread_governor = governor = ThreadGovernor(2, lambda n: None)
    governor.threads, governor.changes = 1, 3
    samples = scrape(server.url)
    assert value(samples, "deskchat_inference_threads") == 1
    assert value(samples, "deskchat_thread_changes_total") == 3
    info = {"model": "fake", "quantization": "none", "cpu_isa": "older", "int8_path": "none"}
    info["decode_step"] = "unknown"  # the fake engine's runtime names none
    assert value(samples, "deskchat_model_info", **info) == 1
    assert value(samples, "process_resident_memory_bytes") > 10_000_000
    assert value(samples, "process_open_fds") > 0
    assert ("process_cpu_seconds_total", ()) in samples


def test_loading_is_counted_as_a_rejection(fake_server):
    server = fake_server(ready=False)
    for _ in range(2):
        assert chat(server.url, {"message": "hi"}).status == 503
    samples = settled(server.url, {("/chat", "503", ""): 2})
    assert value(samples, "deskchat_ready") == 0
    assert ("deskchat_model_info", ()) not in samples
    assert series(samples, "deskchat_rejections_total") == {(("reason", "loading"),): 2}


def test_full_queue_rejections_and_busy_gauges(fake_server):
    server = fake_server(FakeEngine(token_s=0.05), "--max-queue", "2")
    runners = fill_batch(server)
    batch = len(runners)
    waiting = queue_raw_clients(server, ["wait0", "wait1"])
    for _ in range(3):
        assert chat(server.url, {"message": "one too many"}).status == 503
    busy = scrape(server.url)
    assert value(busy, "deskchat_queue_depth") == 2
    assert value(busy, "deskchat_running_jobs") == batch
    for sock in waiting:  # everyone leaves: the queued ones first, then the running ones
        sock.close()
    assert wait_until(lambda: server.worker.depth == 0, 5)  # their handlers saw them go
    for runner in runners:
        runner.close()
    assert wait_until(lambda: not server.worker.busy and server.worker.depth == 0, 5)

    samples = settled(server.url, {("/chat", "503", ""): 3, ("/chat", "499", ""): 2 + batch})
    assert series(samples, "deskchat_rejections_total") == {(("reason", "overloaded"),): 3}
    cancelled = series(samples, "deskchat_cancellations_total")
    assert cancelled == {(("stage", "queued"),): 2, (("stage", "running"),): batch}
    assert value(samples, "deskchat_queue_depth") == 0
    assert value(samples, "deskchat_running_jobs") == 0


def test_cancellations_by_stage(fake_server):
    server = fake_server(FakeEngine(token_s=0.02))
    # running: a stream left after a few tokens, and a plain request left while generating
    stream = Stream(server.url, {"message": "long", "max_tokens": 100_000})
    events = stream.events()
    for _ in range(3):
        next(events)
    stream.close()
    assert wait_until(lambda: not server.worker.busy, 2)
    sock = raw_post(server.url, {"message": "long", "max_tokens": 100_000})
    assert wait_until(lambda: server.worker.busy, 2)
    sock.close()
    assert wait_until(lambda: not server.worker.busy, 2)
    # queued: two requests that leave while a full batch runs
    runners = fill_batch(server, max_tokens=40)
    socks = queue_raw_clients(server, ["gone0", "gone1"])
    for s in socks:
        s.close()
    for runner in runners:
        list(runner.events())
        runner.close()
    assert wait_until(lambda: not server.worker.busy and server.worker.depth == 0, 3)

    ended = {("/chat", "499", ""): 4, ("/chat", "200", ""): len(runners)}
    samples = settled(server.url, ended)
    cancelled = series(samples, "deskchat_cancellations_total")
    assert cancelled == {(("stage", "running"),): 2, (("stage", "queued"),): 2}
    assert series(samples, "deskchat_rejections_total") == {}


def test_timeouts_in_the_queue_and_while_generating(fake_server):
    server = fake_server(
        FakeEngine(token_s=0.02, prefill_s=1.5), "--request-timeout", "0.5", "--max-queue", "2"
    )
    # one passes its deadline in the engine's (uninterruptible) prefill, one in the queue
    statuses = []
    runner = threading.Thread(
        target=lambda: statuses.append(chat(server.url, {"message": "run"}).status)
    )
    runner.start()
    assert server.engine.started.wait(5)
    assert chat(server.url, {"message": "late"}).status == 504
    runner.join(10)
    assert statuses == [504]

    samples = settled(server.url, {("/chat", "504", ""): 2})
    assert value(samples, "deskchat_timeouts_total") == 2
    assert series(samples, "deskchat_cancellations_total") == {}


@pytest.fixture
def keyed(fake_server):
    server = fake_server(FakeEngine(token_s=0.0))
    server.runtime.keys.replace({"wiki": KEY.encode(), "bot": OTHER.encode()})
    return server


def test_with_keys_metrics_needs_one_and_counts_by_key_name(keyed):
    wiki, bot = {"Authorization": f"Bearer {KEY}"}, {"Authorization": f"Bearer {OTHER}"}
    body = {"message": "hi", "max_tokens": 2}
    assert request(keyed.url, "GET", "/metrics").status == 401
    assert request(keyed.url, "GET", "/assets/../metrics").status == 404  # no way around
    for _ in range(2):
        assert request(keyed.url, "POST", "/chat", body, headers=wiki).status == 200
    assert request(keyed.url, "POST", "/chat", body, headers=bot).status == 200
    wrong = {"Authorization": "Bearer " + "x" * 20}
    assert request(keyed.url, "POST", V1, {"messages": []}, headers=wrong).status == 401

    expected = {
        ("/metrics", "401", ""): 1,
        ("/chat", "200", "wiki"): 2,
        ("/chat", "200", "bot"): 1,
        (V1, "401", ""): 1,
        ("/assets/<path:filename>", "404", ""): 1,
    }
    samples = settled(keyed.url, expected, key=("bot", OTHER))
    assert series(samples, "deskchat_rejections_total") == {(("reason", "unauthorized"),): 2}
    assert value(samples, "deskchat_prompt_tokens_total", key="wiki") == 4
    assert value(samples, "deskchat_completion_tokens_total", key="bot") == 2
    # names only, never the keys themselves
    text = request(keyed.url, "GET", "/metrics", headers=wiki).body.decode()
    assert KEY not in text and OTHER not in text


def test_each_app_has_its_own_registry(fake_server):
    first, second = fake_server(), fake_server()
    assert chat(first.url, {"message": "hi", "max_tokens": 1}).status == 200
    settled(first.url, {("/chat", "200", ""): 1})
    assert requests_by(scrape(second.url)) == {}


def test_promtool_accepts_the_scrape(fake_server, tmp_path):
    promtool = shutil.which("promtool")
    if promtool is None:
        skip_unless_ci("promtool (Debian package prometheus) is not installed")
    server = fake_server(FakeEngine(token_s=0.0))
    assert chat(server.url, {"message": "hi", "max_tokens": 3}).status == 200
    assert chat(server.url, {"message": ""}).status == 400
    settled(server.url, {("/chat", "200", ""): 1, ("/chat", "400", ""): 1})
    text = request(server.url, "GET", "/metrics").body
    checked = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, timeout=30
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert checked.stdout.strip() == b"" and checked.stderr.strip() == b"", checked


def test_prometheus_scrapes_it_with_a_bearer_token(fake_server, tmp_path):
    """The real Prometheus server, configured as the README shows, scrapes a keyed server."""
    binary = shutil.which("prometheus")
    if binary is None:
        skip_unless_ci("prometheus (Debian package prometheus) is not installed")
    server = fake_server(FakeEngine(token_s=0.0))
    server.runtime.keys.replace({"prometheus": KEY.encode(), "wiki": OTHER.encode()})
    (tmp_path / "key").write_text(KEY)
    target = f"127.0.0.1:{server.config.port}"
    (tmp_path / "prometheus.yml").write_text(
        "scrape_configs:\n"
        "  - job_name: deskchat\n"
        "    scrape_interval: 1s\n"
        f"    authorization: {{type: Bearer, credentials_file: {tmp_path / 'key'}}}\n"
        f"    static_configs: [{{targets: ['{target}']}}]\n"
    )
    wiki = {"Authorization": f"Bearer {OTHER}"}
    assert request(server.url, "POST", "/chat", {"message": "hi"}, headers=wiki).status == 200
    port = free_port()
    prometheus = subprocess.Popen(
        [
            binary,
            f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    api = f"http://127.0.0.1:{port}"
    query = "/api/v1/query?query=deskchat_requests_total%7Broute%3D%22%2Fchat%22%7D"
    try:

        def scraped() -> list:
            try:
                return request(api, "GET", query, timeout=2).json()["data"]["result"]
            except (OSError, ValueError, KeyError):
                return []

        assert wait_until(lambda: scraped() != [], 30, interval=0.5)
        (result,) = scraped()
        assert result["metric"]["key"] == "wiki" and result["value"][1] == "1"
        targets = request(api, "GET", "/api/v1/targets").json()["data"]["activeTargets"]
        assert [(t["health"], t["lastError"]) for t in targets] == [("up", "")]
    finally:
        prometheus.terminate()
        prometheus.wait(10)
