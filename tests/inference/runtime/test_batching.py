"""Continuous batching: answers that do not depend on the neighbours, jobs that leave alone,
admission bounded by memory, and the whole path through the real server."""

from __future__ import annotations

import dataclasses
import logging
import threading

import pytest

from inference.runtime.jobs import Done, Failed, Job, Sampling
from inference.runtime.schedule import PREFILL_BESIDE, PREFILL_CHUNK
from service.config import load_config
from service.errors import Cancelled, Timeout
from tests.support.engines import batched
from tests.support.fakes import FakeEngine, ids, terminal_events
from tests.support.httpclient import chat, request, wait_until

QUESTIONS = [
    "What is the capital of France?",
    "List three fruits.",
    "写一个 Python 函数，计算斐波那契数列。",
    "Tell me a short story about a cat.",
]
LONG = "Summarize this: " + "the meeting moved the launch to May and hired two engineers. " * 20


@pytest.fixture(scope="module")
def loaded(embedded_dir):
    from inference.loading.assemble import ModelChoice, load_model

    config = dataclasses.replace(load_config([], {}), quantize="int8-row")
    engine, prompts = load_model(ModelChoice(embedded_dir, "embedded"), config, lambda _m: None)
    assert engine.batch_invariant
    return engine, prompts


def encode(prompts, question: str) -> list[int]:
    return prompts.encode([{"role": "user", "content": question}])


def alone(engine, prompt_ids, sampling) -> str:
    parts: list[str] = []
    engine.run(prompt_ids, sampling, parts.append, lambda: False)
    return "".join(parts)


GREEDY = Sampling(max_tokens=24)


@pytest.mark.slow
def test_greedy_answers_are_the_same_alone_and_in_any_batch(loaded):
    engine, prompts = loaded
    prompt_ids = [encode(prompts, q) for q in QUESTIONS]
    expected = [alone(engine, p, GREEDY) for p in prompt_ids]
    assert all(expected) and len(set(expected)) == len(expected)
    for order in ([0, 1], [2, 3, 0, 1], [3, 1], [1, 0, 2]):
        got = batched(engine, [(prompt_ids[i], GREEDY) for i in order])
        assert got == [expected[i] for i in order], order


class Beside:
    """The engine's measured chunk (inference/runtime/schedule.py) held at one size."""

    def __init__(self, rows: int):
        self.rows = rows

    def beside(self) -> int:
        return self.rows

    def observe(self, *_):
        pass


@pytest.mark.slow
@pytest.mark.parametrize("beside", [None, 1, 7])
def test_a_job_admitted_mid_way_and_a_long_prompt_change_no_answer(loaded, beside):
    """Beside decoding streams the long prompt goes in chunks of the measured size; on the
    native step any size, 1 and 7 rows included, gives the same answers."""
    engine, prompts = loaded
    long_ids = encode(prompts, LONG)
    # alone: one 256-row chunk and a tail; beside decoding streams: smaller chunks
    assert len(long_ids) > PREFILL_CHUNK > 3 * PREFILL_BESIDE
    jobs = [(encode(prompts, QUESTIONS[0]), GREEDY), (encode(prompts, QUESTIONS[2]), GREEDY)]
    jobs.append((long_ids, GREEDY))
    expected = [alone(engine, p, s) for p, s in jobs]
    measured = engine.chunks
    if beside is not None:
        if engine.decode_step == "torch":
            pytest.skip("torch's per-row int8 takes whole 16-row blocks only")
        engine.chunks = Beside(beside)
    try:
        assert batched(engine, jobs, joins={1: 3, 2: 5}) == expected
    finally:
        engine.chunks = measured


@pytest.mark.slow
def test_seeded_sampling_and_stop_strings_stay_per_job(loaded):
    engine, prompts = loaded
    sampled = Sampling(max_tokens=24, temperature=0.9, top_p=0.9, seed=7)
    whole = alone(engine, encode(prompts, QUESTIONS[0]), Sampling(max_tokens=24))
    word = whole.split()[3]  # a stop string the greedy answer reaches after a few words
    stopped = Sampling(max_tokens=24, stop=(word,))
    jobs = [
        (encode(prompts, QUESTIONS[3]), sampled),
        (encode(prompts, QUESTIONS[0]), stopped),
        (encode(prompts, QUESTIONS[1]), GREEDY),
    ]
    expected = [alone(engine, p, s) for p, s in jobs]
    assert expected[1] == whole[: whole.index(word)], (word, whole)
    assert batched(engine, jobs) == expected


@pytest.mark.slow
def test_a_job_that_leaves_does_not_harm_the_others(loaded):
    engine, prompts = loaded
    jobs = [(encode(prompts, q), GREEDY) for q in QUESTIONS[:3]]
    expected = [alone(engine, p, s) for p, s in jobs]
    got = batched(engine, jobs, leaves={1: 4})
    assert got[0] == expected[0] and got[2] == expected[2]
    assert expected[1].startswith(got[1]) and got[1] != expected[1]


# -- the worker: who runs, who waits, who leaves (scripted engine) -----------------------------


def test_jobs_run_side_by_side_up_to_max_batch(worker_for):
    engine = FakeEngine(token_s=0.01)
    # why: the cap is the subject; 3, not the shipped 4, so the cap seen is the flag's
    worker = worker_for(engine, max_queue=8, max_batch=3)
    jobs = [worker.submit(Job(ids(f"j{i}"), Sampling(max_tokens=20), 30)) for i in range(5)]
    outcomes = [terminal_events(job)[1] for job in jobs]
    assert all(isinstance(o, Done) and o.usage.completion_tokens == 20 for o in outcomes)
    assert max(engine.batch_sizes) == 3
    assert engine.ran == [ids(f"j{i}") for i in range(5)]  # started in FIFO order


def test_a_cancelled_or_late_job_leaves_at_once_and_the_others_finish(worker_for):
    engine = FakeEngine(token_s=0.02)
    worker = worker_for(engine)
    keep = worker.submit(Job(ids("keep"), Sampling(max_tokens=40), 30))
    gone = worker.submit(Job(ids("gone"), Sampling(max_tokens=1000), 30))
    late = worker.submit(Job(ids("late"), Sampling(max_tokens=1000), 0.3))
    assert wait_until(lambda: worker.running == 3, 5)
    gone.cancel()
    assert wait_until(lambda: worker.running == 2, 1)  # within a step, not at the end
    _, ended = terminal_events(gone)
    assert isinstance(ended, Failed) and isinstance(ended.error, Cancelled)
    _, ended = terminal_events(late)
    assert isinstance(ended, Failed) and isinstance(ended.error, Timeout)
    deltas, done = terminal_events(keep)
    assert isinstance(done, Done) and done.usage.completion_tokens == 40
    assert "".join(deltas) == "".join(f"w{n} " for n in range(1, 41))
    assert worker.cancellations["running"] == 1


def test_admission_waits_while_the_memory_budget_is_used(worker_for):
    engine = FakeEngine(token_s=0.01, bytes_per_token=1000)
    # A job of 4 prompt tokens and 40 answer tokens reserves 44 kB: one fits, two do not.
    worker = worker_for(engine, memory=60_000)  # batch places for both: memory decides
    first = worker.submit(Job(ids("aaaa"), Sampling(max_tokens=40), 30))
    second = worker.submit(Job(ids("bbbb"), Sampling(max_tokens=40), 30))
    assert wait_until(lambda: worker.running == 1, 5)
    assert worker.depth == 1  # the second waits in the queue, not in the batch
    assert isinstance(terminal_events(first)[1], Done)
    assert isinstance(terminal_events(second)[1], Done)
    assert max(engine.batch_sizes) == 1
    # A job bigger than the whole budget still runs, alone.
    big = worker.submit(Job(ids("big"), Sampling(max_tokens=100), 30))
    assert isinstance(terminal_events(big)[1], Done)


def test_an_engine_that_is_not_batch_invariant_runs_one_job_at_a_time(worker_for, caplog):
    engine = FakeEngine(token_s=0.005)
    engine.batch_invariant = False
    with caplog.at_level(logging.INFO, logger="deskchat.worker"):
        worker = worker_for(engine)  # the shipped --max-batch (over 1) falls back to 1
        jobs = [worker.submit(Job(ids(f"j{i}"), Sampling(max_tokens=5), 30)) for i in range(3)]
        assert all(isinstance(terminal_events(job)[1], Done) for job in jobs)
    assert max(engine.batch_sizes) == 1 and worker.max_batch == 1
    assert "running one job at a time" in caplog.text


def test_retry_after_counts_the_batch_places(worker_for):
    engine = FakeEngine(token_s=0.05)
    worker = worker_for(engine)
    batch = worker.max_batch
    assert all(worker.expected_start_s(i) == 0.0 for i in range(batch))  # idle: places free
    jobs = [worker.submit(Job(ids(f"r{i}"), Sampling(max_tokens=1000), 30)) for i in range(batch)]
    assert wait_until(lambda: worker.running == batch, 5)
    # every place taken: the head waits for the first to end, the next for one more job's
    # share of the batch (the 5 s guess / max_batch)
    first, second = worker.expected_start_s(0), worker.expected_start_s(1)
    assert 0 < first <= 5.0 and second == pytest.approx(first + 5.0 / batch, abs=0.1)
    for job in jobs:
        job.cancel()


def test_health_shows_running_and_waiting_jobs(fake_server):
    # why: capacities unlike each other and the shipped ones, so /health reports these flags
    server = fake_server(FakeEngine(token_s=0.05), "--max-batch", "2", "--max-queue", "3")
    holders = []
    for i in range(3):
        thread = threading.Thread(
            target=chat, args=(server.url, {"message": f"h{i}", "max_tokens": 40}), daemon=True
        )
        thread.start()
        holders.append(thread)
    assert wait_until(lambda: server.worker.running == 2 and server.worker.depth == 1, 5)
    body = request(server.url, "GET", "/health").json()
    assert body["batch"] == {"running": 2, "capacity": 2}
    assert body["queue"] == {"depth": 1, "capacity": 3}
    for thread in holders:
        thread.join(20)


# -- the real server -------------------------------------------------------------------------


@pytest.mark.slow
def test_concurrent_requests_to_the_real_server_get_their_lone_answers(start_server):
    # why: batching is the subject; a later shipped --max-batch 1 must not turn it off here
    server = start_server("--model", "embedded", "--max-batch", "4")
    bodies = [{"message": q, "max_tokens": 20} for q in QUESTIONS]
    expected = [chat(server.url, body).json()["response"] for body in bodies]
    replies: list[dict] = [{}] * len(bodies)

    def ask(i):
        replies[i] = chat(server.url, bodies[i]).json()

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(bodies))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert [r["response"] for r in replies] == expected
    # They ran side by side: one at a time, the last would have waited for the others.
    timings = [r["timings"] for r in replies]
    shortest_run = min(t["total_ms"] - t["queued_ms"] for t in timings)
    assert max(t["queued_ms"] for t in timings) < shortest_run


@pytest.mark.slow
@pytest.mark.parametrize("length", [150, 33], ids=["long", "one-row last chunk"])
def test_a_prompts_cache_and_logits_do_not_depend_on_its_chunking(loaded, length):
    """The engine chunks a prompt by the load (big alone, small beside decoding streams):
    every chunking on block boundaries gives bitwise the same keys, values and logits, also
    when the last chunk is one row, and the same next decode step."""
    import torch

    from inference.model.decoder import Segment

    engine, prompts = loaded
    decoder = engine.decoder
    question = "Name three rivers of Europe and say where each one meets the sea. " * 10
    prompt = encode(prompts, question)[:length]
    assert len(prompt) == length
    results = []
    for chunk in (16, 32, 64, length):
        cache = decoder.new_cache(length + 1)
        for start in range(0, length, chunk):
            logits = decoder.forward([Segment(cache, prompt[start : start + chunk])])
        step = decoder.forward([Segment(cache, [prompt[0]], decoding=True)])
        every_layer = cache._buf[:, :, :, : cache.length].clone()  # keys and values
        results.append((chunk, logits, every_layer, step))
    _, first_logits, first_cache, first_step = results[0]
    for chunk, logits, kv, step in results[1:]:
        assert torch.equal(logits, first_logits), chunk
        assert torch.equal(kv, first_cache), chunk
        assert torch.equal(step, first_step), chunk
