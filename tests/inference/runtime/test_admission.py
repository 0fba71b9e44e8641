"""Admission that knows the cost: the prompt budget, and refusing at once what cannot get its
first token before the deadline, from the worker's measured prefill rate and queue wait.
Scripted engine (prompt ids are the code points of the message: its length in tokens)."""

from __future__ import annotations

import time

import pytest

from inference.runtime.batch import FIRST_PREFILL_GUESS_S
from inference.runtime.jobs import Done, Failed, Job, Sampling
from inference.runtime.worker import Worker
from service.errors import PayloadTooLarge
from tests.support.fakes import FakeEngine
from tests.support.httpclient import chat, wait_until


def error_of(reply, status: int, kind: str) -> str:
    assert reply.status == status, reply.body
    error = reply.json()["error"]
    assert error["type"] == kind
    return error["message"]


def test_prefill_rate_is_measured_and_the_first_measurement_replaces_the_guess():
    worker = Worker(FakeEngine(token_s=0.001, prefill_token_s=0.002), max_queue=2).start()
    try:
        assert not worker.measured
        assert worker.expected_prefill_s(1000) == pytest.approx(1000 * FIRST_PREFILL_GUESS_S)
        worker.run_now([7] * 100, Sampling(max_tokens=2))  # 0.2 s of prefill: 2 ms a token
        assert worker.measured
        assert worker.expected_prefill_s(1000) == pytest.approx(2.0, rel=0.25)
        worker.run_now([7] * 10, Sampling(max_tokens=2))  # overhead-heavy: slower per token
        after = worker.expected_prefill_s(1000)
        assert after > 2.0 * 0.9  # moved towards it, not replaced by it
    finally:
        worker.stop()


def test_prompt_over_the_budget_is_413_with_both_numbers(fake_server):
    server = fake_server(FakeEngine(), "--max-prompt-tokens", "50")
    message = error_of(chat(server.url, {"message": "x" * 51}), 413, "too_large")
    assert "51" in message and "50" in message and "--max-prompt-tokens" in message
    assert chat(server.url, {"message": "y" * 50, "max_tokens": 2}).status == 200
    assert server.engine.ran == [[ord("y")] * 50]


def test_prefill_that_can_never_fit_the_deadline_is_413_at_once(fake_server):
    # 10 ms of prefill per prompt token: 100 tokens/s, against a 1 s deadline.
    engine = FakeEngine(token_s=0.001, prefill_token_s=0.01)
    server = fake_server(engine, "--request-timeout", "1")
    server.worker.run_now([1] * 20, Sampling(max_tokens=1))  # the warm-up: the measurement
    started = time.monotonic()
    message = error_of(chat(server.url, {"message": "z" * 300}), 413, "too_large")
    assert time.monotonic() - started < 1.0  # refused at once, not after the deadline
    assert "300 tokens" in message and "1 s request deadline" in message
    assert "prompt tokens/s" in message
    assert [ord("z")] * 300 not in engine.ran
    # One that fits is served.
    assert chat(server.url, {"message": "w" * 50, "max_tokens": 2}).status == 200


def test_only_the_tokens_the_prefix_cache_lacks_count_against_the_deadline(fake_server):
    # The 413 case above, but the prompt's first 288 tokens are held by the prefix cache: 12
    # computed tokens fit the deadline, so it is admitted; a prompt that shares nothing is not.
    import torch

    from inference.model.kvcache import SequenceCache
    from inference.model.prefix_cache import BLOCK, PrefixCache

    engine = FakeEngine(token_s=0.001, prefill_token_s=0.01)
    server = fake_server(engine, "--request-timeout", "1")
    server.worker.run_now([1] * 20, Sampling(max_tokens=1))
    prefixes = server.runtime.prefixes = PrefixCache(1 << 20, memory_is_short=lambda: False)
    held = [ord("z")] * 300
    cache = SequenceCache(1, 1, 8, capacity=300, dtype=torch.float16)
    cache.reserve(300)
    cache.commit(300)
    prefixes.keep(held, cache)
    assert prefixes.cached_tokens(held) == 300 // BLOCK * BLOCK == 288
    # Admitted: the engine starts it (this scripted one computes all 300 tokens anyway, and
    # may pass the deadline; a real engine restores the 288 and computes 12).
    assert chat(server.url, {"message": "z" * 300, "max_tokens": 1}).status != 413
    assert held in engine.ran
    message = error_of(chat(server.url, {"message": "y" * 300}), 413, "too_large")
    assert "300 tokens" in message and "prefix cache" not in message
    held_message = error_of(chat(server.url, {"message": "z" * 290 + "y" * 200}), 413, "too_large")
    assert "490 tokens (288 of them in the prefix cache)" in held_message
    assert "its 202 tokens to compute take about 2.0 s" in held_message


def test_queue_ahead_that_outlasts_the_deadline_is_503_with_honest_retry_after(fake_server):
    # Each job is 40 tokens of 0.1 s: 4 s. The deadline is 4 s, so behind a full batch (the
    # first ends in about 4 s) and a queue one short of full (at the shipped 4 and 4: one
    # more ends every 4 s / max_batch, 3 s in all) no request can get its first token in time.
    engine = FakeEngine(token_s=0.1, prefill_token_s=0.0001)
    server = fake_server(engine, "--request-timeout", "4")
    batch, queued = server.worker.max_batch, server.worker.capacity - 1
    server.worker.run_now([1] * 10, Sampling(max_tokens=40))  # measures a 4 s job

    def submit(count: int) -> list[Job]:
        job = lambda: Job([2] * 10, Sampling(max_tokens=40), timeout_s=60)  # noqa: E731
        return [server.worker.submit(job()) for _ in range(count)]

    ahead = submit(batch)
    try:
        assert wait_until(lambda: server.worker.running == batch, 5)
        ahead += submit(queued)
        assert server.worker.depth == queued
        started = time.monotonic()
        reply = chat(server.url, {"message": "late", "max_tokens": 2})
        assert time.monotonic() - started < 1.0  # refused at once, not a 504 after 4 s
        message = error_of(reply, 503, "overloaded")
        assert "4 s request deadline" in message
        assert server.worker.depth == queued  # the queue was not full: the cost refused it
        # Retry when the wait ahead (about 7 s) has drained to what fits: about 3 s.
        wait_s = server.worker.expected_start_s(queued)
        retry_ms = int(reply.headers["retry-after-ms"])
        assert (wait_s - 4) * 1000 - 1500 < retry_ms < (wait_s - 4) * 1000 + 1500
        assert 2 <= int(reply.headers["retry-after"]) <= 6
    finally:
        for job in ahead:
            job.cancel()
    # With the queue gone, the same request is served.
    assert chat(server.url, {"message": "late", "max_tokens": 2}).status == 200


LONG_NOTES = "Budget approved for the printers; the launch moved to May; two engineers hired. "


@pytest.mark.slow
def test_a_long_prompt_run_in_a_full_batch_is_admitted_alone_after(embedded_dir):
    """The real engine: a long prompt prefilled beside two decoding streams, and a short one
    that waited beside its prefill. The prefill rate learnt is the engine's own work, so
    the estimate for the long prompt alone stays within 2x of what it then takes, and a
    deadline it meets admits it (its time to the first token would have taught the short
    prompt's wait instead)."""
    import dataclasses

    from inference.loading.assemble import ModelChoice, load_model
    from service.config import load_config
    from web.relay import admit

    config = load_config([], {})
    engine, prompts = load_model(ModelChoice(embedded_dir, "embedded"), config, lambda _m: None)
    worker = Worker(engine, max_queue=8, max_batch=4).start()

    def ids(text: str) -> list[int]:
        return prompts.encode([{"role": "user", "content": text}])

    def done(job: Job):
        while not isinstance(event := job.events.get(timeout=600), Done | Failed):
            pass
        assert isinstance(event, Done), event
        return event

    try:
        long_ids = ids("Summarize these notes. " + LONG_NOTES * 70)
        assert len(long_ids) > 1000
        worker.run_now(ids("Hello"), Sampling(max_tokens=4))  # the warm-up
        stories = [
            worker.submit(Job(ids(f"Tell a long story about {x}."), Sampling(max_tokens=160), 600))
            for x in ("a printer", "a stapler")
        ]
        assert wait_until(lambda: worker.running == 2, 30)
        long_job = worker.submit(Job(long_ids, Sampling(max_tokens=4), 600))
        short_job = worker.submit(Job(ids("Say yes."), Sampling(max_tokens=4), 600))
        for job in (*stories, long_job, short_job):
            done(job)
        estimate = worker.expected_prefill_s(len(long_ids))

        engine.prefixes.clear()  # alone and computed in full, as a new PC would
        alone_s = worker.run_now(long_ids, Sampling(max_tokens=1)).ttft_ms / 1000
        assert alone_s / 2 <= estimate <= 2 * alone_s, (estimate, alone_s)
        deadline = dataclasses.replace(config, request_timeout=1.5 * alone_s)
        admit(len(long_ids), deadline, worker)  # raises when refused
        # Its prefix is now cached: a deadline the whole prefill cannot meet admits it.
        now = worker.expected_prefill_s(len(long_ids))  # the alone run taught it too
        tight = dataclasses.replace(config, request_timeout=now / 2)
        with pytest.raises(PayloadTooLarge):
            admit(len(long_ids), tight, worker)
        admit(len(long_ids), tight, worker, engine.prefixes.cached_tokens(long_ids))
    finally:
        worker.stop()
