"""API keys: the key file, the gate on every route but /health, the brake on guessing, the
refusal to open the LAN without keys, and SIGHUP reloading the file."""

from __future__ import annotations

import signal
import threading

import pytest

from service.config import Config
from tests.support.fakes import FakeEngine
from tests.support.httpclient import request, wait_until
from tests.support.keys import KEY, OTHER
from web.access.auth import FailureLimiter, exposure_problem, guessing_unit
from web.access.keys import KeyFileError, KeyRing, parse_keys


def test_key_file_parses_names_and_skips_comments():
    keys = parse_keys(f"# tools\n\nwiki : {KEY}\nbot:{OTHER}\n", "f")
    assert keys == {"wiki": KEY.encode(), "bot": OTHER.encode()}
    ring = KeyRing(keys)
    assert ring.name_of(OTHER) == "bot" and ring.name_of(KEY) == "wiki"
    assert ring.name_of(KEY[:-1]) is None and ring.name_of("") is None


@pytest.mark.parametrize(
    "text, says",
    [
        ("wiki:short", "at least 16"),
        ("wiki:" + "é" * 20, "printable ASCII"),
        (f"no-colon-{KEY}", "expected 'name:key'"),
        (f":{KEY}", "expected 'name:key'"),
        (f"a b:{KEY}", "letters, digits"),
        (f"a:{KEY}\na:{OTHER}", "used twice"),
        (f"a:{KEY}\nb:{KEY}", "also another name's key"),
    ],
)
def test_bad_key_files_are_refused_without_echoing_keys(text, says):
    with pytest.raises(KeyFileError) as refused:
        parse_keys(text, "keys.txt")
    assert says in str(refused.value) and "keys.txt, line" in str(refused.value)
    secret = text.rsplit(":", 1)[-1]  # the last line's key: never echoed
    assert KEY not in str(refused.value) and secret not in str(refused.value)


def test_failure_limiter_blocks_after_the_limit_and_forgets_after_the_window():
    now = [0.0]
    limiter = FailureLimiter(limit=3, window_s=60, clock=lambda: now[0])
    for _ in range(3):
        assert limiter.blocked_for("10.0.0.9") == 0
        limiter.record("10.0.0.9")
    assert limiter.blocked_for("10.0.0.9") == pytest.approx(60)
    assert limiter.blocked_for("10.0.0.8") == 0  # per address
    now[0] = 61.0
    assert limiter.blocked_for("10.0.0.9") == 0


def test_the_brake_counts_ipv6_by_its_64():
    assert guessing_unit("2001:db8:1:2::5") == guessing_unit("2001:db8:1:2:ffff::9")
    assert guessing_unit("2001:db8:1:3::5") != guessing_unit("2001:db8:1:2::5")
    assert guessing_unit("10.0.0.7") == "10.0.0.7" != guessing_unit("10.0.0.8")
    assert guessing_unit("::ffff:10.0.0.7") == "10.0.0.7"


@pytest.mark.parametrize(
    "host, keys, allow, refused",
    [
        ("127.0.0.1", 0, False, False),
        ("localhost", 0, False, False),
        ("::1", 0, False, False),
        ("0.0.0.0", 0, False, True),
        ("192.168.1.20", 0, False, True),
        ("office-pc", 0, False, True),
        ("0.0.0.0", 1, False, False),
        ("0.0.0.0", 0, True, False),
    ],
)
def test_exposure_rule(host, keys, allow, refused):
    problem = exposure_problem(Config(host=host, allow_unauthenticated=allow), keys)
    assert (problem is not None) == refused
    if refused:
        assert "--api-keys-file" in problem and "--allow-unauthenticated" in problem


@pytest.fixture
def keyed_server(fake_server):
    server = fake_server(FakeEngine(token_s=0.0))
    server.runtime.keys.replace({"wiki": KEY.encode(), "bot": OTHER.encode()})
    return server


CHAT = ("/chat", {"message": "hi", "max_tokens": 1})
V1 = ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})


@pytest.mark.parametrize("route", [CHAT, V1], ids=["chat", "v1"])
@pytest.mark.parametrize(
    "headers", [{}, {"Authorization": f"Bearer {KEY}x"}, {"Authorization": f"Basic {KEY}"}]
)
def test_missing_or_wrong_key_is_401_in_the_route_shape(keyed_server, route, headers):
    path, body = route
    reply = request(keyed_server.url, "POST", path, body, headers=headers)
    assert reply.status == 401 and reply.headers["www-authenticate"].startswith("Bearer")
    error = reply.json()["error"]
    expected = 401 if path == "/chat" else "unauthorized"
    assert error["code"] == expected and KEY not in reply.body.decode()
    assert keyed_server.engine.ran == []


@pytest.mark.parametrize(
    "headers",
    [{"Authorization": f"Bearer {KEY}"}, {"X-Api-Key": OTHER}, {"authorization": f"bearer {KEY}"}],
)
def test_a_valid_key_gets_in_everywhere(keyed_server, headers):
    for path, body in (CHAT, V1):
        assert request(keyed_server.url, "POST", path, body, headers=headers).status == 200
    assert request(keyed_server.url, "GET", "/v1/models", headers=headers).status == 200


def test_only_health_and_the_page_are_open(keyed_server):
    for path in ("/health", "/", "/assets/chat.js"):
        assert request(keyed_server.url, "GET", path).status == 200, path
    assert request(keyed_server.url, "HEAD", "/health").status == 200
    for method, path in (
        ("GET", "/v1/models"),
        ("GET", "/metrics"),
        ("GET", "/nothing"),
        ("POST", "/health"),
        ("POST", "/"),
    ):
        assert request(keyed_server.url, method, path).status == 401, (method, path)


def test_repeated_failures_from_one_address_get_429(keyed_server):
    for _ in range(12):  # no key at all is a 401, but not a guess
        assert request(keyed_server.url, "POST", "/chat", CHAT[1]).status == 401
    wrong = {"Authorization": "Bearer " + "x" * 20}
    statuses = [
        request(keyed_server.url, "POST", "/chat", CHAT[1], headers=wrong).status for _ in range(12)
    ]
    assert statuses[:10] == [401] * 10 and statuses[10:] == [429, 429]
    # while blocked, even a good key waits: guessing gains nothing
    right = {"Authorization": f"Bearer {KEY}"}
    reply = request(keyed_server.url, "POST", "/v1/chat/completions", V1[1], headers=right)
    assert reply.status == 429 and 1 <= int(reply.headers["retry-after"]) <= 60
    assert reply.json()["error"]["type"] == "rate_limit_error"


# -- the real server.py ------------------------------------------------------------------


def test_lan_without_keys_refuses_to_start(start_server):
    server = start_server("--host", "0.0.0.0", "--model", "embedded", ready=False)
    assert server.proc.wait(60) == 2
    log = server.log()
    assert "--api-keys-file" in log and "--allow-unauthenticated" in log
    assert "Traceback" not in log


def test_short_key_refuses_to_start(start_server, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("wiki:tooshort\n")
    server = start_server("--api-keys-file", str(keys), "--model", "embedded", ready=False)
    assert server.proc.wait(60) == 2
    assert "at least 16" in server.log() and "tooshort" not in server.log()


@pytest.mark.slow
def test_sighup_reloads_keys_without_dropping_a_request(start_server, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text(f"wiki:{KEY}\n")
    server = start_server("--api-keys-file", str(keys), "--model", "embedded")
    old, new = {"Authorization": f"Bearer {KEY}"}, {"Authorization": f"Bearer {OTHER}"}
    body = {"message": "Count from one to twenty.", "max_tokens": 48}
    assert request(server.url, "POST", "/chat", body, headers=new).status == 401

    running = {}
    during = threading.Thread(
        target=lambda: running.update(reply=request(server.url, "POST", "/chat", body, headers=old))
    )
    during.start()
    busy = lambda: request(server.url, "GET", "/health").json()["busy"]  # noqa: E731
    assert wait_until(busy, 20)  # the old key's request is in, and running
    keys.write_text(f"bot:{OTHER}\n")
    server.proc.send_signal(signal.SIGHUP)
    assert wait_until(lambda: "SIGHUP: 1 API keys in force (bot)" in server.log(), 20)
    during.join(60)
    assert running["reply"].status == 200  # admitted before the reload, answered after
    assert request(server.url, "POST", "/chat", body, headers=new).status == 200
    assert request(server.url, "POST", "/chat", body, headers=old).status == 401
    log = server.log()
    assert "key=bot" in log and "key=wiki" in log and KEY not in log and OTHER not in log

    keys.write_text("bot:short\n")  # a broken edit keeps the keys in force
    server.proc.send_signal(signal.SIGHUP)
    assert wait_until(lambda: "keeping the 1 API keys in force" in server.log(), 20)
    assert request(server.url, "POST", "/chat", body, headers=new).status == 200
