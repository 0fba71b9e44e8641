"""The README and docs/api.md show what the server says: every curl example of the README's
"Using it" and of docs/api.md's "OpenAI clients" and "Tool calls" is sent to a real server
started as `make run` starts it, and its status, the keys of its answer and every value the
page shows are checked (ids, times and the CPU's own figures only by their keys). The JSON
example of docs/api.md's "JSON answers" runs through the openai client and must give the
object its comment shows.

The server is `python server.py` with no model flag, offline: ModelScope is unreachable
(DESKCHAT_MODELSCOPE_ENDPOINT points at a closed loopback port), so it falls back to the
embedded model, as a first `make run` without network does. Its cache holds only the
embedded model, so no cached default model is picked up instead."""

from __future__ import annotations

import ast
import http.client
import json
import re
import shlex
from dataclasses import dataclass

import pytest

from tests.support.paths import ROOT, TEST_CACHE
from tests.support.servers import ServerProcess, free_port

README = (ROOT / "README.md").read_text()
API = (ROOT / "docs" / "api.md").read_text()
KEY = "readme-key-" + "k" * 16  # stands for the README's KEY
ELIDED = "<elided>"  # a value shown as {...}
MORE = "<more>"  # a key set shown with ", ..., " in it: the keys shown are a subset
# Values that differ on every request or machine: only their keys (and presence) are checked.
VARYING = {"id", "created", "timings", "cpu", "decode_step", "prefix_cache"}  # by machine


def section(title: str, text: str = README) -> str:
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def fenced(text: str, lang: str = "") -> list[str]:
    """The bodies of the fenced blocks opened with ```lang."""
    blocks, body, opened = [], None, None
    for line in text.splitlines():
        if line.startswith("```") and body is None:
            body, opened = [], line[3:].strip()
        elif line.startswith("```"):
            if opened == lang:
                blocks.append("\n".join(body) + "\n")
            body = None
        elif body is not None:
            body.append(line)
    return blocks


@dataclass
class Example:
    command: str
    method: str
    path: str
    headers: dict
    body: bytes | None
    shown: list[str]  # the output lines shown under the command

    def __str__(self) -> str:
        return self.command


def parse_curl(command: str, shown: list[str]) -> Example:
    args = shlex.split(command)
    assert args[0] == "curl", command
    method, headers, body, path = None, {}, None, None
    i = 1
    while i < len(args):
        arg = args[i]
        if arg == "-H":
            name, _, value = args[i + 1].partition(":")
            headers[name.strip()] = value.strip().replace("KEY", KEY)
            i += 1
        elif arg == "-d":
            body = args[i + 1].encode()
            i += 1
        elif arg == "-X":
            method = args[i + 1]
            i += 1
        elif not arg.startswith("-"):
            path = "/" + arg.split("/", 1)[1]
        i += 1
    if body is not None:
        headers.setdefault("Content-Type", "application/x-www-form-urlencoded")  # as curl
    return Example(command, method or ("POST" if body else "GET"), path, headers, body, shown)


def complete(command: str) -> bool:
    try:
        shlex.split(command)
    except ValueError:  # a quote not closed on this line
        return False
    return True


def examples(title: str, text: str = README) -> list[Example]:
    found = []
    for block in fenced(section(title, text)):
        lines = block.splitlines()
        if not lines or not lines[0].startswith("curl "):
            continue
        i = 0
        while i < len(lines):
            command = lines[i]
            while command.endswith("\\") or not complete(command):
                i += 1
                if command.endswith("\\"):
                    command = command[:-1] + " " + lines[i].strip()
                else:  # inside a quoted argument: the line break is part of it
                    command += "\n" + lines[i]
            i += 1
            shown = []
            while i < len(lines) and not lines[i].startswith("curl "):
                if lines[i].strip():
                    shown.append(lines[i])
                i += 1
            found.append(parse_curl(command, shown))
    return found


def shown_json(text: str):
    """The README's JSON, with its elisions made explicit: {...} -> ELIDED, and a ', ...,'
    between members -> a MORE key."""
    text = text.replace("{...}", json.dumps(ELIDED))
    text = re.sub(r",\s*\.\.\.\s*,", f', "{MORE}": true,', text)
    return json.loads(text)


def check(shown, real, where: str = "", values: bool = True) -> None:
    """`real` has the keys `shown` has (all of them, unless MORE says the rest was left
    out), and, where `values`, the same values."""
    if shown == ELIDED:
        return
    if isinstance(shown, dict):
        assert isinstance(real, dict), f"{where}: {real!r} is not an object"
        keys = set(shown) - {MORE}
        if MORE in shown:
            assert keys <= set(real), f"{where}: keys {sorted(keys - set(real))} missing"
        else:
            assert keys == set(real), f"{where}: keys {sorted(real)}, README {sorted(keys)}"
        for key in keys:
            check(shown[key], real[key], f"{where}.{key}", values and key not in VARYING)
    elif isinstance(shown, list):
        assert isinstance(real, list) and len(real) == len(shown), f"{where}: {real!r}"
        for n, (a, b) in enumerate(zip(shown, real, strict=True)):
            check(a, b, f"{where}[{n}]", values)
    elif values:
        assert real == shown, f"{where}: the server says {real!r}, the README {shown!r}"
    else:
        assert type(real) is type(shown), f"{where}: {real!r}, README {shown!r}"


def sse_events(lines: list[str]) -> list:
    """data: items of an event stream (the README's, where '...' stands for some left out,
    or the server's)."""
    out = []
    for line in lines:
        if line.strip() == "...":
            out.append(...)
        elif line.startswith("data: "):
            data = line[len("data: ") :]
            out.append(data if data == "[DONE]" else shown_json(data))
    return out


def send(url: str, example: Example) -> tuple[int, bytes]:
    port = int(url.rsplit(":", 1)[1])
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    try:
        conn.request(example.method, example.path, body=example.body, headers=example.headers)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def check_example(url: str, example: Example) -> None:
    status, body = send(url, example)
    if example.shown[0].startswith("data: "):
        assert status == 200, body
        want = sse_events(example.shown)
        got = sse_events(body.decode().splitlines())
        head = want[: want.index(...)] if ... in want else want
        tail = want[len(want) - want[::-1].index(...) :] if ... in want else []
        assert len(got) >= len(head) + len(tail), got
        if ... not in want:
            assert len(got) == len(want), got
        for n, (a, b) in enumerate(zip(head, got, strict=False)):
            check(a, b, f"event {n}")
        for n, (a, b) in enumerate(zip(tail, got[len(got) - len(tail) :], strict=True)):
            check(a, b, f"event {n - len(tail)}")
        return
    want = shown_json("".join(example.shown))
    error = want.get("error", {}) if isinstance(want, dict) else {}
    code = error.get("code")
    expected = code if isinstance(code, int) else ERROR_STATUS.get(code, 200)
    assert status == expected, body
    check(want, json.loads(body))


# OpenAI-shaped errors carry our type as their code, not the status
ERROR_STATUS = {"unauthorized": 401, "invalid_request": 400}

USING_IT = examples("Using it")
OPENAI = examples("OpenAI clients", API)
TOOL_CALLS = examples("Tool calls", API)
# Sections whose curl commands show no output to check.
NOT_SENT = {"Metrics"}


def offline_default_server(tmp_path_factory, *flags: str):
    """server.py as `make run` starts it, offline: the embedded fallback."""
    from inference.loading.embedded import embedded_model_dir

    embedded_model_dir(TEST_CACHE)  # converted once, shared with the other tests
    tmp = tmp_path_factory.mktemp("readme")
    cache = tmp / "cache"
    cache.mkdir()
    (cache / "embedded").symlink_to(TEST_CACHE / "embedded", target_is_directory=True)
    hub = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    proc = ServerProcess(
        tmp, "--cache-dir", str(cache), *flags, env={"DESKCHAT_MODELSCOPE_ENDPOINT": hub}
    )
    return proc


@pytest.fixture(scope="module")
def default_server(tmp_path_factory):
    proc = offline_default_server(tmp_path_factory)
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "api-keys"
    keys.write_text(f"readme:{KEY}\n")
    proc = offline_default_server(tmp_path_factory, "--api-keys-file", str(keys))
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


def test_the_readme_has_its_examples():
    assert len(USING_IT) >= 4 and len(OPENAI) >= 4 and len(TOOL_CALLS) >= 2


def test_every_curl_example_is_sent():
    """No curl example of the README or docs/api.md sits where the tests above do not read:
    each section with one is sent, or listed in NOT_SENT."""
    sent = {str(e) for e in USING_IT + OPENAI + TOOL_CALLS}
    for text in (README, API):
        titles = re.findall(r"^## (.+)$", text, re.MULTILINE)
        for title in titles:
            if title in NOT_SENT:
                continue
            for example in examples(title, text):
                assert str(example) in sent, f"{title}: {example} is not sent"


def test_the_default_start_offline_serves_the_embedded_model(default_server):
    log = default_server.log()
    assert "Qwen/Qwen2.5-0.5B-Instruct" in log and "ready: serving" in log


@pytest.mark.parametrize("example", USING_IT, ids=lambda e: f"{e.method} {e.path}")
def test_using_it(default_server, example):
    check_example(default_server.url, example)


@pytest.mark.parametrize("example", OPENAI, ids=lambda e: f"{e.method} {e.path}")
def test_openai_clients(keyed_server, example):
    check_example(keyed_server.url, example)


@pytest.mark.parametrize("example", TOOL_CALLS, ids=lambda e: f"{e.method} {e.path}")
def test_tool_calls(keyed_server, example):
    check_example(keyed_server.url, example)


def test_json_answers_example(default_server):
    """The python block of docs/api.md's "JSON answers": its last line's comment is what it
    returns."""
    from openai import OpenAI

    (code,) = fenced(section("JSON answers", API), "python")
    *setup, last = ast.parse(code).body
    comment = code.splitlines()[last.end_lineno - 1].split("#", 1)[1]
    names = {"client": OpenAI(base_url=default_server.url + "/v1", api_key="unused")}
    exec(compile(ast.Module(setup, type_ignores=[]), "README", "exec"), {"json": json}, names)
    got = eval(compile(ast.Expression(last.value), "README", "eval"), {"json": json}, names)
    assert got == json.loads(comment)
