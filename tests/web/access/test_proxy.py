"""web/access/proxy.py: which request ids are kept, and when X-Forwarded-For names the client."""

from __future__ import annotations

import ipaddress

import pytest

from service.config import ConfigError, load_config
from tests.support.fakes import FakeEngine
from tests.support.httpclient import chat, request
from web.access.proxy import client_address, parse_networks, request_id_from


@pytest.mark.parametrize(
    "value",
    [
        "a",
        "0123456789abcdef0123456789abcdef",  # nginx's $request_id
        "chat-7be6e818039c409f",
        "tool.build:42_A-b",
        "x" * 128,
    ],
)
def test_well_formed_request_ids_are_kept(value):
    assert request_id_from({"X-Request-Id": value}) == value


@pytest.mark.parametrize(
    "value",
    [
        pytest.param("", id="empty"),
        pytest.param("x" * 129, id="too long"),
        pytest.param("a b", id="space"),
        pytest.param("id\r\nX-Evil: 1", id="header injection"),
        pytest.param("id\nrequest forged status=200", id="log injection"),
        pytest.param("<script>", id="markup"),
        pytest.param("ünïcode", id="non-ascii"),
        pytest.param("a/b", id="slash"),
        pytest.param("a,b", id="list"),
    ],
)
def test_malformed_request_ids_are_refused(value):
    assert request_id_from({"X-Request-Id": value}) is None


def test_no_request_id_header():
    assert request_id_from({}) is None


def test_parse_networks():
    assert parse_networks("") == ()
    assert parse_networks(" 10.0.0.5 , 192.168.1.0/24,,::1 ") == (
        ipaddress.ip_network("10.0.0.5/32"),
        ipaddress.ip_network("192.168.1.0/24"),
        ipaddress.ip_network("::1/128"),
    )
    assert parse_networks("192.168.1.7/24") == (ipaddress.ip_network("192.168.1.0/24"),)
    with pytest.raises(ValueError):
        parse_networks("10.0.0.300")


NGINX = parse_networks("10.0.0.5")
TWO_PROXIES = parse_networks("10.0.0.5, 172.16.0.0/12")


@pytest.mark.parametrize(
    ("remote", "forwarded", "trusted", "client"),
    [
        pytest.param("192.168.1.20", None, (), "192.168.1.20", id="direct"),
        pytest.param("192.168.1.20", "6.6.6.6", (), "192.168.1.20", id="nobody trusted"),
        pytest.param("192.168.1.20", "6.6.6.6", NGINX, "192.168.1.20", id="peer not trusted"),
        pytest.param("10.0.0.5", "192.168.1.20", NGINX, "192.168.1.20", id="through nginx"),
        pytest.param("10.0.0.5", None, NGINX, "10.0.0.5", id="nginx without the header"),
        pytest.param("10.0.0.5", "", NGINX, "10.0.0.5", id="nginx with an empty header"),
        pytest.param(
            "10.0.0.5", "6.6.6.6, 192.168.1.20", NGINX, "192.168.1.20", id="client forged a hop"
        ),
        pytest.param(
            "10.0.0.5",
            "192.168.1.20, 172.16.3.4",
            TWO_PROXIES,
            "192.168.1.20",
            id="two trusted proxies",
        ),
        pytest.param(
            "10.0.0.5", "172.16.3.4, 10.0.0.5", TWO_PROXIES, "172.16.3.4", id="all hops trusted"
        ),
        pytest.param(
            "10.0.0.5", "192.168.1.20, garbage", NGINX, "10.0.0.5", id="malformed last hop"
        ),
        pytest.param(
            "10.0.0.5",
            "garbage, 192.168.1.20, 172.16.3.4",
            TWO_PROXIES,
            "192.168.1.20",
            id="malformed beyond the client",
        ),
        pytest.param("::ffff:10.0.0.5", "192.168.1.20", NGINX, "192.168.1.20", id="v4-mapped"),
        pytest.param("::1", "fd00::7", parse_networks("::1"), "fd00::7", id="ipv6"),
        pytest.param(None, "192.168.1.20", NGINX, "-", id="no peer address"),
    ],
)
def test_client_address(remote, forwarded, trusted, client):
    assert client_address(remote, forwarded, trusted) == client


def test_trusted_proxies_setting():
    assert load_config([], environ={}).trusted_proxies is None
    config = load_config([], environ={"DESKCHAT_TRUSTED_PROXIES": "10.0.0.5,10.1.0.0/16"})
    assert parse_networks(config.trusted_proxies) == parse_networks("10.0.0.5, 10.1.0.0/16")
    with pytest.raises(ConfigError, match="--trusted-proxies"):
        load_config(["--trusted-proxies", "10.0.0.5,nginx.lan"], environ={})


def test_server_keeps_a_well_formed_request_id(fake_server):
    server = fake_server(FakeEngine(token_s=0.0))
    reply = request(
        server.url, "POST", "/chat", {"message": "hi"}, headers={"X-Request-Id": "tool-42.a"}
    )
    assert reply.status == 200
    assert reply.headers["x-request-id"] == "tool-42.a" == reply.json()["id"]

    reply = request(
        server.url, "POST", "/chat", {"message": "hi"}, headers={"X-Request-Id": "bad id!"}
    )
    assert reply.json()["id"].startswith("chat-")
    assert reply.headers["x-request-id"] == reply.json()["id"]


def test_errors_carry_the_incoming_request_id(fake_server):
    server = fake_server(FakeEngine(token_s=0.0))
    reply = request(server.url, "POST", "/chat", {"message": ""}, headers={"X-Request-Id": "e-1"})
    assert reply.status == 400 and reply.headers["x-request-id"] == "e-1"
    assert chat(server.url, {"message": "hi"}).headers["x-request-id"].startswith("chat-")


@pytest.mark.parametrize(
    ("flags", "remote", "client"),
    [
        pytest.param([], "10.0.0.5", "10.0.0.5", id="no trusted proxy"),
        pytest.param(["--trusted-proxies", "10.0.0.0/24"], "10.0.0.5", "192.168.1.20", id="nginx"),
        pytest.param(["--trusted-proxies", "10.0.0.0/24"], "10.9.0.1", "10.9.0.1", id="other peer"),
    ],
)
def test_app_sets_the_client_for_every_request(flags, remote, client):
    from flask import g

    from web.app import Runtime, create_app

    app = create_app(load_config(flags, environ={}), Runtime())
    app.add_url_rule("/who", "who", lambda: {"client": g.client, "id": g.request_id})
    reply = app.test_client().get(
        "/who",
        headers={"X-Forwarded-For": "6.6.6.6, 192.168.1.20", "X-Request-Id": "r-1"},
        environ_base={"REMOTE_ADDR": remote},
    )
    assert reply.get_json() == {"client": client, "id": "r-1"}
