"""Several deskchat PCs behind a real nginx, configured by system/nginx/fleet-conf.sh.

Three deskchat servers on loopback (the scripted engine; the embedded model where the answer
matters), nginx in front as an ordinary process with its config in a temp dir.
The runs with nginx in front of servers are marked slow (`make check`); the checks of
fleet-conf.sh's output and arguments are quick and stay in `make test`.
"""

from __future__ import annotations

import http.client
import logging
import re
import socket
import subprocess
import threading
import time
from types import SimpleNamespace

import flask
import pytest

from tests.support.fake_backend import BackendProcess
from tests.support.fakes import FakeEngine
from tests.support.httpclient import Stream, chat, request, wait_until
from tests.support.nginx import FLEET_CONF, Nginx, fleet_conf, nginx_binary
from tests.support.servers import free_port
from tests.support.traffic import leave_a_plain_request, leave_a_stream, raw_post


@pytest.fixture
def start_nginx(tmp_path):
    """Start nginx in front of a list of HOST:PORT; stopped at teardown."""
    started: list[Nginx] = []

    def start(pcs: list[str], **options) -> Nginx:
        where = tmp_path / f"nginx-{len(started)}"
        where.mkdir()
        proxy = Nginx(where, pcs, **options)
        started.append(proxy)
        return proxy

    yield start
    for proxy in started:
        proxy.stop()


@pytest.fixture
def fleet(fake_server, start_nginx):
    """Three scripted-engine servers and nginx in front of them, at the shipped --max-batch:
    "full" is a whole batch running and the queue full."""

    def make(*flags: str, token_s: float = 0.02, pcs: int = 3):
        servers = [fake_server(FakeEngine(token_s=token_s), *flags) for _ in range(pcs)]
        proxy = start_nginx([address(s) for s in servers])
        return servers, proxy

    return make


def address(server) -> str:
    return server.url.removeprefix("http://")


def holds(server) -> int:
    """The requests a PC takes before it refuses: a whole batch running and the FIFO full."""
    return server.worker.max_batch + server.worker.capacity


def full(server) -> bool:
    """Every batch place running and the FIFO full."""
    worker = server.worker
    return worker.running == worker.max_batch and worker.depth == worker.capacity


def taken(server) -> int:
    return server.worker.running + server.worker.depth


def admitted(server) -> bool:
    """Nothing waits while a batch place is free: the next request cannot meet a full FIFO
    that the worker was about to empty (it admits between steps)."""
    return server.worker.depth == 0 or server.worker.running == server.worker.max_batch


def fill(server) -> list[socket.socket]:
    """Long requests straight to the server, around nginx, until its batch and queue are
    full (one by one, each in its place before the next arrives)."""
    socks = []
    for n in range(1, holds(server) + 1):
        socks.append(raw_post(server.url, {"message": "hold", "max_tokens": 100_000}))
        assert wait_until(lambda n=n: taken(server) == n and admitted(server), 5)
    assert full(server)
    return socks


def close_all(socks: list[socket.socket]) -> None:
    for sock in socks:
        sock.close()


def access_entry(proxy: Nginx, request_id: str) -> dict:
    """nginx's access log line for a request id, as {"status", "pc", "pc_status"}."""
    for _ in range(50):  # nginx writes the line when the request ends
        for line in proxy.access_lines():
            if f" id={request_id} " in line:
                status = line.split('" ', 1)[1].split()[0]
                pc = line.split(' pc="', 1)[1].split('"')[0]
                pc_status = line.split(' pc_status="', 1)[1].split('"')[0]
                return {"status": int(status), "pc": pc.split(", "), "pc_status": pc_status}
        time.sleep(0.05)
    raise AssertionError(f"no access log line for {request_id}: {proxy.access_lines()}")


@pytest.mark.slow
def test_thirty_requests_spread_over_three_pcs(fleet, caplog):
    caplog.set_level(logging.INFO, logger="deskchat.http")
    servers, proxy = fleet(token_s=0.02)
    replies = []

    def client(n: int) -> None:
        for i in range(5):
            replies.append(chat(proxy.url, {"message": f"c{n}r{i}", "max_tokens": 5}))

    threads = [threading.Thread(target=client, args=(n,)) for n in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [r.status for r in replies] == [200] * 30
    assert all(r.json()["response"] == "w1 w2 w3 w4 w5 " for r in replies)
    served = [len(s.engine.ran) for s in servers]
    assert sum(served) == 30 and min(served) >= 5, served
    # One id per request, in nginx's log, the PC's log and the answer (nginx made them).
    ids = {r.headers["x-request-id"] for r in replies}
    assert len(ids) == 30 and all(r.json()["id"] == r.headers["x-request-id"] for r in replies)
    assert all(len(i) == 32 and access_entry(proxy, i)["status"] == 200 for i in ids)
    assert all(re.search(rf"request {i} .*status=200", caplog.text) for i in ids)


def echo_route(server) -> dict:
    """Add GET /who to a fake server's app: what the PC made of the request it got."""
    seen: dict = {}

    def who():
        key = flask.request.headers.get("Authorization")
        seen.update(client=flask.g.client, id=flask.g.request_id, key=key)
        return {}

    server.app.add_url_rule("/who", "who", who)
    return seen


def get_who(proxy: Nginx, headers: dict) -> http.client.HTTPResponse:
    """GET /who through nginx from 127.0.0.2, so the client is not nginx's own 127.0.0.1."""
    conn = http.client.HTTPConnection("127.0.0.1", proxy.port, source_address=("127.0.0.2", 0))
    try:
        conn.request("GET", "/who", headers=headers)
        reply = conn.getresponse()
        reply.read()
        return reply
    finally:
        conn.close()


@pytest.mark.slow
def test_request_id_and_api_key_pass_through_unchanged(fake_server, start_nginx):
    server = fake_server(FakeEngine())
    seen = echo_route(server)
    proxy = start_nginx([address(server)])
    key = {"Authorization": "Bearer dc-secret-key"}
    reply = get_who(proxy, {"X-Request-Id": "tool-7.a", **key})
    assert reply.status == 200 and reply.getheader("X-Request-Id") == "tool-7.a"
    assert seen["id"] == "tool-7.a" and seen["key"] == key["Authorization"]
    # Without one, or with a malformed one, nginx makes the id: nginx and the PC log the same.
    for headers in ({}, {"X-Request-Id": "a b"}):
        reply = get_who(proxy, headers)
        assert len(seen["id"]) == 32 and reply.getheader("X-Request-Id") == seen["id"]
        assert access_entry(proxy, seen["id"])["status"] == 200


@pytest.mark.slow
def test_the_pc_names_the_client_behind_a_trusted_nginx(fake_server, start_nginx):
    server = fake_server(FakeEngine(), "--trusted-proxies", "127.0.0.1")
    seen = echo_route(server)
    proxy = start_nginx([address(server)])
    get_who(proxy, {"X-Forwarded-For": "6.6.6.6"})  # a forged hop, left of nginx's own
    assert seen["client"] == "127.0.0.2"


@pytest.mark.slow
def test_a_full_pc_is_skipped(fleet):
    servers, proxy = fleet("--max-queue", "1", token_s=0.02)
    held = fill(servers[0])
    ran_before = len(servers[0].engine.ran)
    replies = [chat(proxy.url, {"message": f"r{i}", "max_tokens": 3}) for i in range(6)]
    assert [r.status for r in replies] == [200] * 6
    assert len(servers[0].engine.ran) == ran_before
    # The one that met the full PC was retried: nginx logged the 503 and then the answer.
    tried = [access_entry(proxy, r.json()["id"]) for r in replies]
    assert any(t["pc_status"].startswith("503, ") for t in tried)
    assert all(t["pc"][-1] != address(servers[0]) for t in tried)
    close_all(held)


@pytest.mark.slow
def test_no_503_reaches_the_client_until_every_pc_is_full(fleet):
    servers, proxy = fleet("--max-queue", "1", token_s=0.02)
    held = []
    in_place = lambda n: sum(map(taken, servers)) > n and all(map(admitted, servers))  # noqa: E731
    for n in range(sum(map(holds, servers))):  # each PC: a batch running, one queued
        held.append(raw_post(proxy.url, {"message": f"hold{n}", "max_tokens": 100_000}))
        assert wait_until(lambda n=n: in_place(n), 5)
    assert all(full(s) for s in servers)
    for _ in range(3):
        started = time.monotonic()
        reply = chat(proxy.url, {"message": "one too many"})
        assert time.monotonic() - started < 2
        # deskchat's own 503, or nginx's once every PC is left out: the same JSON shape.
        assert reply.status == 503 and reply.headers["content-type"] == "application/json"
        error = reply.json()["error"]
        assert error["code"] == 503 and error["type"] in ("overloaded", "unavailable")
        assert int(reply.headers["retry-after"]) >= 1
        assert reply.headers["x-request-id"]
    close_all(held)


@pytest.mark.slow
def test_a_pc_full_a_moment_ago_is_used_when_the_others_are_full(fleet):
    # A 503 makes nginx leave a PC out for 10 s; the backup entries still reach it.
    servers, proxy = fleet("--max-queue", "1", token_s=0.02)
    first, second, third = servers
    held = fill(first)
    assert chat(proxy.url, {"message": "meets the full one", "max_tokens": 3}).status == 200
    close_all(held)
    assert wait_until(lambda: not first.worker.busy and first.worker.depth == 0, 5)
    held = fill(second) + fill(third)
    ran_before = len(first.engine.ran)
    reply = chat(proxy.url, {"message": "finds the free one", "max_tokens": 3})
    assert reply.status == 200, reply.body
    assert len(first.engine.ran) == ran_before + 1
    close_all(held)


@pytest.mark.slow
def test_a_switched_off_pc_costs_one_connect_timeout(fake_server, start_nginx):
    # A PC that is off answers nothing: a socket whose backlog is full drops every SYN.
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(0)
    parked = socket.create_connection(silent.getsockname())
    servers = [fake_server(FakeEngine(token_s=0.0)) for _ in range(2)]
    off = "{}:{}".format(*silent.getsockname())
    proxy = start_nginx([off, *map(address, servers)])
    took = []
    for i in range(6):
        started = time.monotonic()
        reply = chat(proxy.url, {"message": f"r{i}", "max_tokens": 2})
        took.append(time.monotonic() - started)
        assert reply.status == 200, reply.body
    assert sum(len(s.engine.ran) for s in servers) == 6
    # One request met the silent PC and waited out the 1 s connect timeout; nginx left
    # that PC out afterwards.
    slow = sorted(took)
    assert 0.9 < slow[-1] < 2.5 and slow[-2] < 0.5, took
    assert sum(off in line for line in proxy.access_lines()) == 1, proxy.access_lines()
    parked.close()
    silent.close()


@pytest.fixture
def backends(tmp_path):
    started: list[BackendProcess] = []

    def start(*flags: str, token_s: float) -> BackendProcess:
        backend = BackendProcess(tmp_path, *flags, token_s=token_s)
        started.append(backend)
        return backend

    yield start
    for backend in started:
        backend.stop()


def run_through(proxy: Nginx, request_id: str, stream: bool, results: dict) -> None:
    """One request through nginx; results[id] = "ok", "cut" (a stream that broke), or status."""
    body = {"message": request_id, "max_tokens": 60}
    headers = {"X-Request-Id": request_id}
    try:
        if not stream:
            reply = request(proxy.url, "POST", "/chat", body, headers=headers)
            results[request_id] = "ok" if reply.status == 200 else reply.status
            return
        s = Stream(proxy.url, body, headers=headers)
        if s.status != 200:
            results[request_id] = s.status
            return
        try:
            events = list(s.events())
        finally:
            s.close()
        results[request_id] = "ok" if events and events[-1][1].get("done") else "cut"
    except (http.client.HTTPException, OSError):
        results[request_id] = "cut"


@pytest.mark.slow
def test_a_pc_killed_mid_run_fails_only_what_it_was_answering(backends, start_nginx):
    pcs = [backends(token_s=0.05) for _ in range(3)]
    victim = pcs[0]
    batch = request(victim.url, "GET", "/health").json()["batch"]["capacity"]
    proxy = start_nginx([pc.address for pc in pcs])
    results: dict = {}
    # Per PC a whole batch of streams running and one more waiting, then a plain request per
    # PC (waits too): the two queued on the killed PC still fit in the others' queues.
    streams = 3 * (batch + 1)
    total = streams + 3
    threads = [
        threading.Thread(target=run_through, args=(proxy, f"k{i}", i < streams, results))
        for i in range(total)
    ]
    for t in threads:
        t.start()
        time.sleep(0.05)

    def victim_is_answering() -> bool:
        reply = request(victim.url, "GET", "/health", timeout=5).json()
        return reply["busy"] and reply["queue"]["depth"] >= 1

    assert wait_until(victim_is_answering, 5)
    time.sleep(0.5)  # its running jobs are streaming tokens by now
    victim.kill()
    for t in threads:
        t.join(60)
    assert len(results) == total

    # Only streams that had begun on the killed PC broke; nginx sent everything else, queued
    # there or not yet answered, to the other PCs.
    for request_id, outcome in results.items():
        entry = access_entry(proxy, request_id)
        if outcome != "ok":
            assert outcome == "cut" and entry["pc"] == [victim.address], (request_id, entry)
    assert list(results.values()).count("cut") >= 1
    assert any(
        victim.address in access_entry(proxy, r)["pc"][:-1] for r in results if results[r] == "ok"
    ), "no request was moved off the killed PC"

    after = [chat(proxy.url, {"message": f"after{i}", "max_tokens": 3}) for i in range(6)]
    assert [r.status for r in after] == [200] * 6
    assert all(access_entry(proxy, r.json()["id"])["pc"][-1] != victim.address for r in after)


@pytest.mark.slow
def test_a_stream_arrives_token_by_token(fleet):
    _, proxy = fleet(token_s=0.1)
    s = Stream(proxy.url, {"message": "count", "max_tokens": 10})
    started = time.monotonic()
    arrivals = []
    for _, data in s.events():
        arrivals.append((time.monotonic() - started, data))
    s.close()
    assert "".join(d.get("delta", "") for _, d in arrivals) == "".join(
        f"w{i} " for i in range(1, 11)
    )
    assert arrivals[-1][1]["done"] is True
    # Ten tokens at 0.1 s: the first is passed on at once, not with the rest at the end.
    assert arrivals[0][0] < 0.5 and arrivals[-1][0] - arrivals[0][0] > 0.6, arrivals


@pytest.mark.slow
@pytest.mark.parametrize("leave", [leave_a_stream, leave_a_plain_request])
def test_a_client_leaving_through_nginx_cancels_its_job(fleet, leave):
    servers, proxy = fleet(token_s=0.02, pcs=1)
    leave(SimpleNamespace(url=proxy.url, engine=servers[0].engine))  # leaves nginx, not the PC
    assert wait_until(lambda: not servers[0].worker.busy, 2)  # uncancelled: 20 s
    assert servers[0].engine.tokens_made[-1] < 80


@pytest.mark.slow
def test_the_real_model_answers_the_same_through_nginx(embedded_server, start_nginx):
    proxy = start_nginx([embedded_server.url.removeprefix("http://")])
    body = {"message": "What is the capital of Japan?", "max_tokens": 16}  # support/margins.py
    direct = chat(embedded_server.url, body).json()["response"]
    through = chat(proxy.url, body)
    assert through.status == 200 and through.json()["response"] == direct
    assert "Tokyo" in direct
    s = Stream(proxy.url, body)
    streamed = "".join(d.get("delta", "") for _, d in s.events())
    s.close()
    assert streamed == direct


def test_fleet_conf_is_valid_nginx_for_any_list(tmp_path):
    pcs = ["192.168.1.21:8080", "[fd00::22]:8081", "10.0.0.3:80"]
    conf = fleet_conf(pcs, "--access-log", str(tmp_path / "access.log"))
    assert conf.count(" backup max_fails=0;") == 3
    assert "proxy_next_upstream_tries 6;" in conf and "@" not in conf.replace("@deskchat_", "")
    (tmp_path / "deskchat-fleet.conf").write_text(conf)
    main = (
        f"pid {tmp_path}/nginx.pid; events {{}} http {{ include {tmp_path}/deskchat-fleet.conf; }}"
    )
    (tmp_path / "nginx.conf").write_text(main)
    done = subprocess.run(
        [
            nginx_binary(),
            "-t",
            "-p",
            str(tmp_path),
            "-c",
            str(tmp_path / "nginx.conf"),
            "-e",
            str(tmp_path / "error.log"),
        ],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize(
    "args",
    [[], ["pc-one"], ["10.0.0.1:80", "--listen", "x"], ["--request-timeout", "1.5", "a:1"]],
)
def test_fleet_conf_refuses_bad_arguments(args):
    done = subprocess.run([str(FLEET_CONF), *args], capture_output=True, text=True)
    assert done.returncode == 2 and done.stderr and not done.stdout


@pytest.mark.slow
def test_nginx_logs_no_prompt(fleet):
    _, proxy = fleet()
    reply = chat(proxy.url, {"message": "a private question", "max_tokens": 2})
    assert reply.status == 200
    assert access_entry(proxy, reply.json()["id"])["status"] == 200
    assert "private" not in "\n".join(proxy.access_lines())


@pytest.mark.slow
def test_no_pc_reachable_is_one_json_503(start_nginx):
    proxy = start_nginx([f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"])  # all off
    started = time.monotonic()
    reply = request(proxy.url, "POST", "/chat", {"message": "hi"}, headers={"X-Request-Id": "n-1"})
    assert time.monotonic() - started < 2
    assert reply.status == 503 and reply.headers["content-type"] == "application/json"
    assert reply.json()["error"]["type"] == "unavailable" and reply.json()["error"]["code"] == 503
    assert reply.headers["retry-after"] == "10" and reply.headers["x-request-id"] == "n-1"
