"""Starting server.py for real: fallback, strict mode, and what it tells systemd."""

from __future__ import annotations

import json
import signal
import socket
import tempfile
import threading
import time
from pathlib import Path

import pytest

from tests.support.httpclient import Stream, chat, request, wait_until
from tests.support.servers import NO_NETWORK, free_port


def unreachable_hub() -> str:
    return f"http://127.0.0.1:{free_port()}"  # nothing listens there


@pytest.mark.slow
def test_missing_default_model_falls_back_with_one_warning(start_server):
    server = start_server("--modelscope-endpoint", unreachable_hub(), ready=False)
    server.wait_ready(timeout=120)
    health = request(server.url, "GET", "/health").json()
    assert health["model"] == "SmolLM2-135M-Instruct"
    warnings = [line for line in server.log().splitlines() if " WARNING " in line]
    assert len(warnings) == 1
    assert "Qwen/Qwen2.5-0.5B-Instruct" in warnings[0] and "embedded" in warnings[0]


def test_strict_mode_exits_nonzero_saying_what_to_do(start_server):
    server = start_server("--modelscope-endpoint", unreachable_hub(), "--strict-model", ready=False)
    started = time.monotonic()
    code = server.proc.wait(60)
    assert code != 0
    assert time.monotonic() - started < 30
    log = server.log()
    assert "cannot start" in log and "--model embedded" in log
    assert "Traceback" not in log


def test_bad_setting_is_refused_before_anything_loads(start_server):
    server = start_server("--max-queue", "zero", ready=False)
    assert server.proc.wait(30) == 2
    assert "--max-queue" in server.log() and "Traceback" not in server.log()


def _taken_port(tmp_path, held):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    held.append(sock)
    return ["--port", str(sock.getsockname()[1])]


def _file(tmp_path, _held):
    (tmp_path / "a-file").write_text("not a folder\n")
    return tmp_path / "a-file"


def _model_folder(tmp_path, files: dict[str, str]) -> str:
    folder = tmp_path / "model"
    folder.mkdir()
    for name, text in files.items():
        (folder / name).write_text(text)
    return str(folder)


def _truncated_weights(tmp_path, _held):
    import shutil

    from inference.loading.embedded import embedded_model_dir
    from tests.support.paths import TEST_CACHE

    folder = tmp_path / "truncated"
    shutil.copytree(embedded_model_dir(TEST_CACHE), folder)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100_000])
    return ["--model", str(folder)]


# (flags, or a function of (tmp_path, sockets to hold) giving them; words the one line has)
MISUSES = {
    "port taken": (_taken_port, ["already in use", "--port"]),
    "port too high": (["--port", "70000"], ["--port", "65535"]),
    "port zero": (["--port", "0"], ["--port", "from 1"]),
    "port not a number": (["--port", "http"], ["--port", "whole number"]),
    "host not an address": (["--host", "999.1.1.1"], ["--host", "not an IP address"]),
    "host with a space": (["--host", "my pc"], ["--host", "not an IP address"]),
    "host that does not resolve": (["--host", "nosuch.invalid"], ["--host", "resolve"]),
    "host not on this PC": (
        ["--host", "192.0.2.1", "--allow-unauthenticated"],
        ["192.0.2.1", "not an address of this PC"],
    ),
    "cache dir is a file": (
        lambda tmp, held: ["--model", "embedded", "--cache-dir", str(_file(tmp, held))],
        ["--cache-dir", "is a file"],
    ),
    "cache dir under a file": (
        lambda tmp, held: ["--cache-dir", str(_file(tmp, held) / "cache")],
        ["--cache-dir", "is a file"],
    ),
    "model folder missing": (["--model", "/nonexistent/model"], ["--model", "no config.json"]),
    "broken config.json": (
        lambda tmp, _: ["--model", _model_folder(tmp, {"config.json": '{"model_type": '})],
        ["--model", "config.json is not readable JSON"],
    ),
    "no weights": (
        lambda tmp, _: [
            "--model",
            _model_folder(tmp, {"config.json": '{"model_type": "llama"}', "tokenizer.json": "{}"}),
        ],
        ["--model", "no weights"],
    ),
    "architecture not served": (  # refused before any conversion: the weights are empty
        lambda tmp, _: [
            "--model",
            _model_folder(
                tmp,
                {
                    "config.json": json.dumps(
                        {"model_type": "gemma2", "architectures": ["Gemma2ForCausalLM"]}
                    ),
                    "model.safetensors": "",
                },
            ),
        ],
        ["--model", "Gemma2ForCausalLM is not served", "Qwen3ForCausalLM"],
    ),
    "truncated weights": (_truncated_weights, ["cannot load the model", "--model embedded"]),
    "timeout not finite": (["--request-timeout", "nan"], ["--request-timeout", "finite"]),
    "unknown log level": (["--log-level", "loud"], ["--log-level", "DEBUG, INFO"]),
    "queue of zero": (["--max-queue", "0"], ["--max-queue", "from 1"]),
    "empty model": (["--model="], ["--model", "got nothing"]),
}


@pytest.mark.parametrize(("make_flags", "words"), MISUSES.values(), ids=MISUSES.keys())
def test_a_startup_misuse_is_one_line_and_exit_2(start_server, tmp_path, make_flags, words):
    held: list[socket.socket] = []
    flags = make_flags(tmp_path, held) if callable(make_flags) else make_flags
    try:
        server = start_server(*flags, ready=False)
        code = server.proc.wait(120)
    finally:
        for sock in held:
            sock.close()
    log = server.log()
    said = [line for line in log.splitlines() if " ERROR " in line or line.startswith("server.py")]
    assert code == 2, log
    assert len(said) == 1, log
    assert all(word in said[0] for word in words), said[0]
    assert "Traceback" not in log


def test_a_model_id_the_hub_does_not_know_is_an_error_not_a_fallback(start_server):
    from tests.support.modelscope_standin import ModelScopeStandin

    with ModelScopeStandin({"acme/tiny-chat": {"config.json": b"{}"}}) as hub:
        server = start_server(
            "--modelscope-endpoint", hub.url, "--model", "acme/no-such-chat", ready=False
        )
        assert server.proc.wait(60) == 2
    errors = [line for line in server.log().splitlines() if " ERROR " in line]
    assert len(errors) == 1 and "acme/no-such-chat" in errors[0] and "--model" in errors[0]
    assert " WARNING " not in server.log() and "Traceback" not in server.log()


def test_too_few_file_descriptors_for_the_connection_limit_is_one_line(start_server):
    server = start_server(
        "--connection-limit", "5000", wrapper=["prlimit", "--nofile=1024:1024"], ready=False
    )
    assert server.proc.wait(60) == 2
    assert "--connection-limit" in server.log() and "LimitNOFILE" in server.log()
    assert "Traceback" not in server.log()


class NotifyListener:
    """A unix datagram socket standing in for systemd's NOTIFY_SOCKET."""

    def __init__(self):
        self.dir = Path(tempfile.mkdtemp(prefix="dc-notify-", dir="/tmp"))
        self.path = str(self.dir / "notify")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.sock.settimeout(0.2)
        self.messages: list[tuple[float, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._listen, daemon=True)
        self._thread.start()

    def _listen(self):
        while not self._stop.is_set():
            try:
                data = self.sock.recv(4096)
            except TimeoutError:
                continue
            self.messages.append((time.monotonic(), data.decode()))

    def texts(self) -> list[str]:
        return [m for _, m in self.messages]

    def close(self):
        self._stop.set()
        self._thread.join(2)
        self.sock.close()


@pytest.mark.slow
def test_ready_is_sent_after_warm_up_and_watchdog_while_alive(start_server):
    listener = NotifyListener()
    try:
        server = start_server(
            "--model",
            "embedded",
            ready=False,
            env={"NOTIFY_SOCKET": listener.path, "WATCHDOG_USEC": "400000"},
        )
        end = time.monotonic() + 120
        while "READY=1" not in listener.texts() and time.monotonic() < end:
            assert server.proc.poll() is None, server.log()
            time.sleep(0.01)
        # READY=1 means ready: /health must already say so at that moment.
        assert request(server.url, "GET", "/health").status == 200
        texts = listener.texts()
        ready = texts.index("READY=1")
        statuses = [t for t in texts[:ready] if t.startswith("STATUS=")]
        assert any("loading" in s for s in statuses)
        assert statuses[-1].startswith("STATUS=ready") and "STATUS=warming up" in statuses
        assert statuses.index("STATUS=warming up") < len(statuses) - 1
        assert not any(t == "WATCHDOG=1" for t in texts[:ready])
        # idle, a ping every 0.2 s: five a second (two at most if the idle worker beat
        # only once a second, as it did before a short WatchdogSec shortened its tick)
        time.sleep(1.0)
        assert listener.texts().count("WATCHDOG=1") >= 3
        server.stop()
        assert "STOPPING=1" in listener.texts()
    finally:
        listener.close()


@pytest.mark.slow
def test_default_model_downloads_from_the_hub_then_starts_offline(start_server, tmp_path):
    """The whole first-start path: snapshot_download from a loopback hub, load, serve; then a
    second start from the cache with the hub gone and no fallback allowed."""
    from inference.loading.embedded import embedded_model_dir
    from tests.support.modelscope_standin import ModelScopeStandin
    from tests.support.paths import TEST_CACHE

    model_dir = embedded_model_dir(TEST_CACHE)  # a real model to play the default one
    files = {p.name: p.read_bytes() for p in model_dir.iterdir() if p.is_file()}
    cache = str(tmp_path / "cache")
    with ModelScopeStandin({"Qwen/Qwen2.5-0.5B-Instruct": files}) as hub:
        first = start_server(
            "--modelscope-endpoint", hub.url, "--cache-dir", cache, "--strict-model"
        )
        assert "model.safetensors" in hub.file_requests()
    # Not France: a near-tie in fp32 (tests/web/dialects/test_openai_client.py)
    reply = chat(first.url, {"message": "What is the capital of Japan?"}).json()
    assert reply["model"] == "Qwen/Qwen2.5-0.5B-Instruct" and "Tokyo" in reply["response"]
    assert first.stop() == 0

    # Second start: no network at all (its own network namespace), no fallback allowed.
    second = start_server("--cache-dir", cache, "--strict-model", wrapper=NO_NETWORK, ready=False)
    assert wait_until(
        lambda: "ready: serving" in second.log() or second.proc.poll() is not None, 120
    ), second.log()
    assert "ready: serving Qwen/Qwen2.5-0.5B-Instruct" in second.log(), second.log()
    assert " WARNING " not in second.log()
    assert second.stop() == 0


@pytest.mark.slow
def test_sigterm_ends_running_and_queued_requests_with_503(start_server):
    # At the shipped --max-batch: a whole batch runs, one more waits in the FIFO.
    server = start_server("--model", "embedded")
    batch = request(server.url, "GET", "/health").json()["batch"]["capacity"]
    assert batch > 1
    body = {"message": "Tell me a very long story.", "max_tokens": 1000}
    running = [Stream(server.url, body) for _ in range(batch)]
    streams = [s.events() for s in running]
    for events in streams:
        next(events)
    queued: dict = {}
    waiter = threading.Thread(target=lambda: queued.update(r=chat(server.url, {"message": "hi"})))
    waiter.start()
    assert wait_until(lambda: request(server.url, "GET", "/health").json()["queue"]["depth"], 5)
    server.proc.send_signal(signal.SIGTERM)
    for stream, events in zip(running, streams, strict=True):
        rest = list(events)
        stream.close()
        assert rest[-1][0] == "error" and rest[-1][1]["error"]["code"] == 503
        assert rest[-1][1]["error"]["type"] == "unavailable"
    waiter.join(10)
    assert queued["r"].status == 503 and queued["r"].json()["error"]["type"] == "unavailable"
    assert server.proc.wait(15) == 0
    assert "Traceback" not in server.log()


@pytest.mark.slow
def test_sigterm_while_loading_exits_cleanly(start_server):
    server = start_server("--model", "embedded", ready=False)
    assert wait_until(lambda: "listening on" in server.log(), 30)
    loading = request(server.url, "GET", "/health")  # the port is open before the model
    assert loading.status == 503 and loading.json()["status"] == "loading"
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(30) == 0
    assert "Traceback" not in server.log()


@pytest.mark.slow
def test_a_model_without_chat_template_is_refused_clearly(start_server, tmp_path, embedded_dir):
    import shutil

    folder = tmp_path / "no-template"
    shutil.copytree(embedded_dir, folder)
    (folder / "chat_template.jinja").unlink()
    server = start_server("--model", str(folder), ready=False)
    assert server.proc.wait(120) == 2
    assert "no chat template" in server.log() and "Traceback" not in server.log()


def test_without_a_compiler_the_torch_step_serves_and_the_log_says_so(start_server, tmp_path):
    """No native library built yet and no compiler to build one (CC names none, nothing in
    its folder or the cache): one WARNING line saying what it costs, /health says torch,
    and the answers come."""
    server = start_server(
        "--model",
        "embedded",
        env={"CC": str(tmp_path / "no-such-cc"), "DESKCHAT_NATIVE_DIR": str(tmp_path / "lib")},
    )
    health = request(server.url, "GET", "/health").json()
    assert health["decode_step"] == "torch"
    assert "weights_sha256" not in health  # its answers may differ by CPU: no digest
    assert health["cpu"]["paths"]["int8_row"] != "native"
    warnings = [line for line in server.log().splitlines() if " WARNING " in line]
    assert len(warnings) == 1, warnings
    assert "native decode step unavailable" in warnings[0] and "torch step serves" in warnings[0]
    reply = chat(server.url, {"message": "What is the capital of Japan?", "max_tokens": 8})
    assert reply.status == 200 and "Tokyo" in reply.json()["response"]


@pytest.mark.slow
def test_a_models_generation_config_sets_the_defaults_unless_greedy_is_asked(
    start_server, tmp_path, embedded_dir
):
    """The embedded model with Qwen2.5's sampling defaults written beside it: /health and
    /v1/models show them, a silent request samples with them (a seed repeats its text);
    --sampling-defaults greedy serves temperature 0 instead."""
    import json
    import shutil

    folder = tmp_path / "with-defaults"
    shutil.copytree(embedded_dir, folder)
    generation = json.loads((folder / "generation_config.json").read_text())
    generation |= {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20}
    generation["repetition_penalty"] = 1.1
    (folder / "generation_config.json").write_text(json.dumps(generation))
    expected = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "min_p": 0.0}
    expected |= {"repetition_penalty": 1.1, "source": "generation_config.json"}

    server = start_server("--model", str(folder))
    assert request(server.url, "GET", "/health").json()["sampling_defaults"] == expected
    [card] = request(server.url, "GET", "/v1/models").json()["data"]
    assert card["sampling_defaults"] == expected
    ask = {"message": "Write a haiku about autumn.", "max_tokens": 24, "seed": 7}
    first = chat(server.url, ask).json()["response"]
    assert chat(server.url, ask).json()["response"] == first
    assert server.stop() == 0

    greedy = start_server("--model", str(folder), "--sampling-defaults", "greedy")
    defaults = request(greedy.url, "GET", "/health").json()["sampling_defaults"]
    assert defaults["temperature"] == 0.0 and defaults["repetition_penalty"] == 1.0
    silent = chat(greedy.url, {**ask, "seed": None}).json()["response"]
    assert silent == chat(greedy.url, {**ask, "temperature": 0}).json()["response"]
