"""Servers for the tests: the fake-engine app on a real waitress server in this process, the
real `python server.py` as a child process, a free loopback port, and a no-network wrapper."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from inference.runtime.worker import Worker
from server import make_http_server, start_http_thread
from service.config import load_config
from tests.support.fakes import FakeEngine, FakePrompts
from tests.support.httpclient import request
from tests.support.paths import ROOT, TEST_CACHE
from web.app import Runtime, create_app


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
            self.runtime.prompts = FakePrompts(max_prompt_tokens=config.max_prompt_tokens)
            self.runtime.model_name = engine.name
            self.runtime.worker = self.worker
        self.app = create_app(self.config, self.runtime)
        self.server = make_http_server(self.config, self.app)
        start_http_thread(self.server)
        self.url = f"http://127.0.0.1:{self.config.port}"

    def close(self):
        self.worker.stop()  # its jobs end first, so the request threads can finish
        self.server.close()


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


# Runs a command in a network namespace of its own with only loopback up: no route out.
NO_NETWORK = ["unshare", "--net", "sh", "-c", 'ip link set lo up && exec "$@"', "no-network"]
