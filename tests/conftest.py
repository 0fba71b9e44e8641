"""Fixtures, shared by every folder: the embedded model, fake-engine servers in this process,
the real server.py process, and workers around scripted engines (the classes are in
tests/support/servers.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from inference.runtime.worker import Worker
from service.config import Config
from tests.support.fakes import FakeEngine
from tests.support.paths import TEST_CACHE
from tests.support.servers import InProcessServer, ServerProcess


@pytest.fixture(scope="session")
def embedded_dir() -> Path:
    """The embedded model, converted once into the test cache."""
    from inference.loading.embedded import embedded_model_dir

    return embedded_model_dir(TEST_CACHE)


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


@pytest.fixture(scope="session")
def embedded_server(tmp_path_factory):
    """One real server with the embedded model, shared by every test that asks for it (one
    start instead of one per module: test_server, test_json_output, test_threads, test_fleet
    use the same flags, and each test checks only its own requests)."""
    proc = ServerProcess(tmp_path_factory.mktemp("srv"), "--model", "embedded")
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


@pytest.fixture
def worker_for():
    """Workers around scripted engines, stopped at teardown; at the shipped --max-queue and
    --max-batch unless a test says otherwise."""
    workers = []

    def make(
        engine: FakeEngine,
        max_queue: int = Config.max_queue,
        max_batch: int = Config.max_batch,
        memory: int | None = None,
    ) -> Worker:
        w = Worker(engine, max_queue, max_batch=max_batch, batch_memory=memory).start()
        workers.append(w)
        return w

    yield make
    for w in workers:
        w.stop()


@pytest.fixture
def keep_threads():
    """A test that sets torch's thread count (or loads a model, or runs a bench with
    --threads) gives the process its count back."""
    import torch

    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)
