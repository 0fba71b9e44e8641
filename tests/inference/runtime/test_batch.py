"""The running batch (inference/runtime/batch.py) without the worker's thread: stepping the
scripted engine by hand, how each job ends, and the times the ended ones leave behind.
Through the worker: test_worker.py, test_batching.py, test_isolation.py."""

from __future__ import annotations

import threading
import time

import pytest

from inference.runtime.batch import FIRST_GUESS_S, FIRST_PREFILL_GUESS_S, Batch, Running
from inference.runtime.jobs import Delta, Done, Failed, Job, Sampling
from service.errors import Internal
from tests.support.fakes import FakeEngine, ids

TOKENS = 3


def running(batch: Batch, engine: FakeEngine, text: str, max_tokens: int = TOKENS) -> Running:
    job = Job(ids(text), Sampling(max_tokens=max_tokens), timeout_s=30)
    entry = Running(job, engine.open(job.prompt_ids, job.sampling), time.monotonic(), 0)
    batch.join(entry)
    return entry


def events(job: Job) -> list:
    found = []
    while not job.events.empty():
        found.append(job.events.get_nowait())
    return found


def test_jobs_step_together_and_leave_with_done_and_the_times_measured():
    engine = FakeEngine(token_s=0.001, prefill_token_s=0.01)  # 10 ms per prompt token
    batch = Batch(threading.Condition())
    short, long = running(batch, engine, "ab", max_tokens=1), running(batch, engine, "cd")
    assert not batch.measured
    assert batch.expected_prefill_s(100) == pytest.approx(100 * FIRST_PREFILL_GUESS_S)
    while batch.entries:
        assert batch.step(engine)
        batch.settle(engine)
    assert engine.batch_sizes == [2, 1, 1]  # one step together, then the long one alone
    for entry, tokens in ((short, 1), (long, TOKENS)):
        *deltas, done = events(entry.job)
        assert "".join(d.text for d in deltas if isinstance(d, Delta)) == "w1 w2 w3 "[: 3 * tokens]
        assert isinstance(done, Done) and done.usage.completion_tokens == tokens
    assert batch.measured
    assert batch.expected_prefill_s(100) == pytest.approx(1.0)  # the engine's own prefill
    assert batch.expected_start_s(1, max_batch=1) < FIRST_GUESS_S  # measured, not the guess
    assert batch.expected_start_s(0, max_batch=2) == 0.0  # a free place starts at once


class FailingEngine(FakeEngine):
    def step(self, streams) -> None:
        raise RuntimeError("the forward")


def test_a_failing_forward_ends_every_job_in_it():
    engine = FailingEngine()
    batch = Batch(threading.Condition())
    entries = [running(batch, engine, "ab"), running(batch, engine, "cd")]
    assert batch.step(engine) is False
    assert batch.entries == []
    for entry in entries:
        [failed] = events(entry.job)
        assert isinstance(failed, Failed) and isinstance(failed.error, Internal)
        assert entry.job.id in failed.error.message


def test_a_stream_that_failed_alone_leaves_alone():
    engine = FakeEngine(token_s=0.001)
    batch = Batch(threading.Condition())
    bad, good = running(batch, engine, "ab"), running(batch, engine, "cd")
    assert batch.step(engine)
    bad.stream.error = RuntimeError("its own sampling")
    batch.settle(engine)
    assert batch.entries == [good]
    assert isinstance(events(bad.job)[-1], Failed)
    assert [type(e) for e in events(good.job)] == [Delta]
