"""inference.loading.download against a loopback stand-in of the ModelScope hub (no internet)."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from inference.loading.download import ModelNotFound, ModelUnavailable, fetch_modelscope_model
from tests.support.modelscope_standin import ModelScopeStandin
from tests.support.paths import ROOT

MODEL_ID = "acme/tiny-chat"
REVISION = "master"


def safetensors_bytes(data: bytes) -> bytes:
    """A real safetensors file holding `data` as one uint8 tensor (header length, header, data)."""
    header = json.dumps(
        {"w": {"dtype": "U8", "shape": [len(data)], "data_offsets": [0, len(data)]}}
    )
    return len(header).to_bytes(8, "little") + header.encode() + data


# What a transformers load reads...
NEEDED = {
    "config.json": json.dumps({"model_type": "llama", "hidden_size": 8}).encode(),
    "generation_config.json": b'{"max_new_tokens": 16}',
    "tokenizer.json": b'{"version": "1.0", "model": {}}',
    "tokenizer_config.json": b'{"chat_template": "{{ messages }}"}',
    "merges.txt": b"#version: 0.2\na b\n",
    "model.safetensors": safetensors_bytes(bytes(range(256)) * 4),
}
# ...and what it doesn't: duplicates in other formats, exports, docs.
SKIPPED = {
    "pytorch_model.bin": b"\x00" * 512,
    "model-q4.gguf": b"GGUF" + b"\x00" * 60,
    "onnx/model.onnx": b"onnx-bytes",
    "onnx/config.json": b"{}",
    "README.md": b"# tiny chat\n",
}


@pytest.fixture
def hub():
    with ModelScopeStandin({MODEL_ID: {**NEEDED, **SKIPPED}}, revision=REVISION) as standin:
        yield standin


def no_network(monkeypatch) -> list[object]:
    """Make every outgoing connection and DNS lookup in this process fail, and record the tries."""
    attempts: list[object] = []

    def refuse(*args, **kwargs):
        attempts.append(args)
        raise OSError("network access blocked by test")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    return attempts


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def assert_one_line_with_advice(exc: ModelUnavailable, cache_dir: Path) -> None:
    message = str(exc)
    assert "\n" not in message and message.strip() == message
    assert MODEL_ID in message
    assert str(cache_dir) in message
    assert "--model PATH" in message and "--model embedded" in message
    assert "connect" in message


def test_first_fetch_downloads_only_the_needed_files(hub, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="deskchat.download")

    folder = fetch_modelscope_model(MODEL_ID, REVISION, tmp_path, endpoint=hub.url)

    assert folder.is_dir() and folder.is_relative_to(tmp_path)
    for name, data in NEEDED.items():
        assert (folder / name).read_bytes() == data
    for name in SKIPPED:
        assert not (folder / name).exists()
    assert sorted(hub.file_requests()) == sorted(NEEDED)
    listing = [r for r in hub.requests if r.path == f"/api/v1/models/{MODEL_ID}/repo/files"]
    assert listing and listing[0].query["Revision"] == REVISION
    assert all(r.query.get("Revision", REVISION) == REVISION for r in hub.requests)
    text = caplog.text
    assert f"downloading {MODEL_ID}@{REVISION} from {hub.url}" in text
    assert "downloaded" in text and " s to " in text


def test_cached_model_starts_with_no_network_at_all(hub, tmp_path, monkeypatch, caplog):
    first = fetch_modelscope_model(MODEL_ID, REVISION, tmp_path, endpoint=hub.url)
    served = len(hub.requests)
    hub.stop()
    attempts = no_network(monkeypatch)
    caplog.set_level(logging.INFO, logger="deskchat.download")

    again = fetch_modelscope_model(MODEL_ID, REVISION, tmp_path, endpoint=hub.url)

    assert again == first
    assert attempts == []
    assert len(hub.requests) == served
    assert f"found {MODEL_ID}@{REVISION} in cache at {first}" in caplog.text
    # And the default endpoint (modelscope.cn) is not consulted either.
    assert fetch_modelscope_model(MODEL_ID, REVISION, tmp_path) == first
    assert attempts == []


def test_prefilled_modelscope_cache_layout_is_found_without_network(tmp_path, monkeypatch):
    # The layout modelscope's snapshot_download writes under cache_dir (seen in the test above).
    snapshot = tmp_path / "models" / MODEL_ID.replace("/", "--") / "snapshots" / REVISION
    snapshot.mkdir(parents=True)
    for name, data in NEEDED.items():
        (snapshot / name).write_bytes(data)
    attempts = no_network(monkeypatch)

    folder = fetch_modelscope_model(MODEL_ID, REVISION, tmp_path, endpoint="http://127.0.0.1:9")

    assert folder == snapshot
    assert attempts == []


FRESH_START = """
import socket, sys
tries = []
def refuse(*args, **kwargs):
    tries.append(args)
    raise OSError("network access blocked by test")
socket.socket.connect = socket.socket.connect_ex = refuse
socket.create_connection = socket.getaddrinfo = refuse
from inference.loading.download import fetch_modelscope_model
print(fetch_modelscope_model(sys.argv[1], "master", sys.argv[2]))
print(len(tries))
"""


def test_fresh_process_with_cached_model_imports_and_finds_it_without_network(hub, tmp_path):
    # What a server start does: a new interpreter importing modelscope, sockets blocked from line 1.
    first = fetch_modelscope_model(MODEL_ID, REVISION, tmp_path, endpoint=hub.url)
    hub.stop()

    done = subprocess.run(
        [sys.executable, "-c", FRESH_START, MODEL_ID, str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )

    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [str(first), "0"]


def test_other_revision_is_not_taken_from_cache(hub, tmp_path, monkeypatch):
    fetch_modelscope_model(MODEL_ID, REVISION, tmp_path, endpoint=hub.url)
    hub.stop()
    no_network(monkeypatch)

    with pytest.raises(ModelUnavailable):
        fetch_modelscope_model(MODEL_ID, "v2.0", tmp_path, endpoint=hub.url)


def test_interrupted_download_in_cache_is_completed_not_used(hub, tmp_path):
    snapshot = tmp_path / "models" / MODEL_ID.replace("/", "--") / "snapshots" / REVISION
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_bytes(NEEDED["config.json"])
    (snapshot / "model.safetensors.incomplete").write_bytes(NEEDED["model.safetensors"][:10])

    folder = fetch_modelscope_model(MODEL_ID, REVISION, tmp_path, endpoint=hub.url)

    assert folder == snapshot
    assert (folder / "model.safetensors").read_bytes() == NEEDED["model.safetensors"]
    assert not list(folder.rglob("*.incomplete"))
    assert "model.safetensors" in hub.file_requests()


def cut_weights(folder: Path) -> None:
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])  # as a full disk or a crash leaves it


def test_damaged_weights_in_cache_are_fetched_again(hub, tmp_path):
    folder = fetch_modelscope_model(MODEL_ID, REVISION, tmp_path, endpoint=hub.url)
    cut_weights(folder)
    fetched_before = len(hub.file_requests())

    again = fetch_modelscope_model(MODEL_ID, REVISION, tmp_path, endpoint=hub.url)

    assert (again / "model.safetensors").read_bytes() == NEEDED["model.safetensors"]
    assert "model.safetensors" in hub.file_requests()[fetched_before:]


def test_damaged_weights_in_cache_offline_are_named(hub, tmp_path):
    folder = fetch_modelscope_model(MODEL_ID, REVISION, tmp_path, endpoint=hub.url)
    cut_weights(folder)
    hub.stop()

    with pytest.raises(ModelUnavailable) as info:
        fetch_modelscope_model(MODEL_ID, REVISION, tmp_path, endpoint=hub.url)

    message = str(info.value)
    assert "damaged" in message and "model.safetensors" in message and str(folder) in message
    assert "\n" not in message


def test_default_endpoint_honours_modelscope_endpoint_env(hub, tmp_path, monkeypatch):
    monkeypatch.setenv("MODELSCOPE_ENDPOINT", hub.url)

    folder = fetch_modelscope_model(MODEL_ID, REVISION, tmp_path)

    assert (folder / "config.json").read_bytes() == NEEDED["config.json"]
    assert sorted(hub.file_requests()) == sorted(NEEDED)


@pytest.mark.parametrize(
    ("model_id", "revision"),
    [("acme/no-such-model", REVISION), (MODEL_ID, "no-such-revision")],
    ids=["unknown model", "unknown revision"],
)
def test_what_the_hub_does_not_have_is_not_found_in_one_line(hub, tmp_path, model_id, revision):
    with pytest.raises(ModelNotFound) as info:
        fetch_modelscope_model(model_id, revision, tmp_path, endpoint=hub.url)

    message = str(info.value)
    assert "\n" not in message
    assert model_id in message and revision in message and "--model" in message


def test_closed_port_fails_fast_with_advice(tmp_path):
    endpoint = f"http://127.0.0.1:{closed_port()}"
    started = time.monotonic()

    with pytest.raises(ModelUnavailable) as info:
        fetch_modelscope_model(MODEL_ID, REVISION, tmp_path, endpoint=endpoint)

    assert time.monotonic() - started < 5
    assert_one_line_with_advice(info.value, tmp_path)
    assert endpoint in str(info.value) and "refused" in str(info.value)


def test_silent_endpoint_fails_within_30_s_with_advice(tmp_path):
    # Listens (so TCP connects succeed) but never accept()s or answers: a blackhole.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        endpoint = f"http://127.0.0.1:{silent.getsockname()[1]}"
        started = time.monotonic()

        with pytest.raises(ModelUnavailable) as info:
            fetch_modelscope_model(MODEL_ID, REVISION, tmp_path, endpoint=endpoint)  # default 10 s

        elapsed = time.monotonic() - started
    assert elapsed < 30
    assert_one_line_with_advice(info.value, tmp_path)
    assert endpoint in str(info.value)


@pytest.mark.slow
def test_server_output_to_a_file_has_log_lines_not_progress_bars(hub, tmp_path):
    # What the journal gets: server.py's output is not a terminal. modelscope's tqdm bars
    # (carriage returns, cursor moves) became "[147B blob data]" there.
    log_path = tmp_path / "server.log"
    with open(log_path, "wb") as out:
        done = subprocess.run(
            [
                sys.executable,
                "server.py",
                "--model",
                MODEL_ID,
                "--modelscope-endpoint",
                hub.url,
                "--cache-dir",
                str(tmp_path / "cache"),
                "--port",
                str(closed_port()),
            ],
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={k: v for k, v in os.environ.items() if not k.startswith(("DESKCHAT_", "TQDM_"))},
            timeout=120,
        )
    output = log_path.read_bytes()
    assert done.returncode == 2  # the stand-in's weights are no model: one ERROR line
    bar = (b"\r", b"\x1b[", b"%|")  # redraw, cursor move, tqdm's "45%|####  |"
    assert not any(mark in output for mark in bar), output.decode(errors="replace")
    for name in NEEDED:
        assert f"deskchat.download: fetched {name} (".encode() in output


def test_progress_bars_stay_on_a_terminal(monkeypatch):
    from server import PROGRESS_BARS_OFF, quiet_progress_bars

    for name in PROGRESS_BARS_OFF:
        monkeypatch.setenv(name, "")  # restored at the end, whatever quiet_progress_bars does
        monkeypatch.delenv(name)
    leader, follower = os.openpty()
    with open(follower, "w") as terminal:
        quiet_progress_bars(terminal)
    os.close(leader)
    assert not any(name in os.environ for name in PROGRESS_BARS_OFF)
    with open(os.devnull, "w") as file:
        quiet_progress_bars(file)
    assert all(os.environ[name] == "1" for name in PROGRESS_BARS_OFF)
