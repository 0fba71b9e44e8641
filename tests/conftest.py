"""Fixtures: a fake-engine app on a real waitress server, and the real server.py process."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from inference.runtime.worker import Worker
from server import make_http_server, start_http_thread
from service.config import load_config
from tests.support.fakes import FakeEngine, FakePrompts
from tests.support.httpclient import request
from tests.support.paths import ROOT, TEST_CACHE
from web.app import Runtime, create_app


@pytest.fixture(scope="session")
def embedded_dir() -> Path:
    """The embedded model, converted once into the test cache."""
    from inference.loading.embedded import embedded_model_dir

    return embedded_model_dir(TEST_CACHE)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class InProcessServer:
    """create_app + waitress in a thread, around a worker with a scripted engine."""

    def __init__(self, engine: FakeEngine, *flags: str, ready: bool = True):
        self.config = load_config(["--port", str(free_port()), *flags], environ={})
        self.engine = engine
        self.runtime = Runtime()
        config = self.config
        self.worker = Worker(
            engine, config.max_queue, config.max_batch, config.batch_memory_mb * 1024 * 1024
        ).start()
        if ready:
            self.runtime.prompts = FakePrompts()
            self.runtime.model_name = engine.name
            self.runtime.worker = self.worker
        self.app = create_app(self.config, self.runtime)
        self.server = make_http_server(self.config, self.app)
        start_http_thread(self.server)
        self.url = f"http://127.0.0.1:{self.config.port}"

    def close(self):
        self.server.close()
        self.worker.stop()


@pytest.fixture
def fake_server():
    servers: list[InProcessServer] = []

    def start(engine: FakeEngine | None = None, *flags: str, ready: bool = True):
        server = InProcessServer(engine or FakeEngine(), *flags, ready=ready)
        servers.append(server)
        return server

    yield start
    for s in servers:
        s.close()


class ServerProcess:
    """The real `python server.py` on a loopback port, its log in a file."""

    def __init__(
        self, tmp: Path, *flags: str, env: dict | None = None, wrapper: list[str] | None = None
    ):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp / f"server-{self.port}.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        args = [
            sys.executable,
            str(ROOT / "server.py"),
            "--port",
            str(self.port),
            "--cache-dir",
            str(TEST_CACHE),
            *flags,
        ]
        self.proc = subprocess.Popen(
            [*(wrapper or []), *args],
            cwd=ROOT,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        )

    def wait_ready(self, timeout: float = 300) -> ServerProcess:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited {self.proc.returncode}:\n{self.log()}")
            try:
                if request(self.url, "GET", "/health", timeout=5).status == 200:
                    return self
            except OSError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"server not ready in {timeout} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


@pytest.fixture
def start_server(tmp_path):
    """Start server.py with extra flags; stopped at teardown."""
    procs: list[ServerProcess] = []

    def start(
        *flags: str, env: dict | None = None, ready: bool = True, wrapper: list[str] | None = None
    ) -> ServerProcess:
        proc = ServerProcess(tmp_path, *flags, env=env, wrapper=wrapper)
        procs.append(proc)
        return proc.wait_ready() if ready else proc

    yield start
    for p in procs:
        p.stop()


# Runs a command in a network namespace of its own with only loopback up: no route out.
NO_NETWORK = ["unshare", "--net", "sh", "-c", 'ip link set lo up && exec "$@"', "no-network"]


@pytest.fixture(scope="module")
def embedded_server(tmp_path_factory):
    """One real server with the embedded model, shared by a module's tests."""
    proc = ServerProcess(tmp_path_factory.mktemp("srv"), "--model", "embedded")
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


@pytest.fixture
def worker_for():
    """Workers around scripted engines, stopped at teardown."""
    workers = []

    def make(
        engine: FakeEngine, max_queue: int = 4, max_batch: int = 1, memory: int | None = None
    ) -> Worker:
        w = Worker(engine, max_queue, max_batch=max_batch, batch_memory=memory).start()
        workers.append(w)
        return w

    yield make
    for w in workers:
        w.stop()
