"""The worker on its own: FIFO order, bounds, deadlines, cancellation, failures."""

from __future__ import annotations

import queue
import threading
import time

import pytest

from inference.runtime.jobs import Delta, Done, Failed, Job, Sampling
from inference.runtime.worker import Worker
from service.errors import Cancelled, Internal, Overloaded, Timeout, Unavailable
from tests.support.fakes import FakeEngine, ids, terminal_events
from tests.support.httpclient import wait_until


def fill_batch(worker: Worker, max_tokens: int = 10_000) -> list[Job]:
    """Every batch place running a long job ("run0", "run1"...), submitted one by one so a
    short queue never overflows; returns them."""
    jobs = []
    for i in range(worker.max_batch):
        job = Job(ids(f"run{i}"), Sampling(max_tokens=max_tokens), timeout_s=30)
        jobs.append(worker.submit(job))
        assert wait_until(lambda n=i + 1: worker.running == n, 5)
    return jobs


def cancel(jobs: list[Job]) -> None:
    for job in jobs:
        job.cancel()


def test_jobs_run_in_submission_order_from_many_threads(worker_for):
    engine = FakeEngine(token_s=0.001)
    worker = worker_for(engine, max_queue=64)
    submitted: queue.Queue = queue.Queue()
    lock = threading.Lock()  # makes "the order of submit()" well defined across threads

    def client(n: int):
        job = Job(ids(f"job{n}"), Sampling(max_tokens=2), timeout_s=30)
        with lock:
            worker.submit(job)
            submitted.put(job.prompt_ids)

    threads = [threading.Thread(target=client, args=(n,)) for n in range(40)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    order = [submitted.get() for _ in range(40)]
    deadline = time.monotonic() + 10
    while len(engine.tokens_made) < 40 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.ran == order


def test_done_carries_usage_and_timings(worker_for):
    worker = worker_for(FakeEngine(token_s=0.001))
    job = worker.submit(Job(ids("hello"), Sampling(max_tokens=3), timeout_s=30))
    deltas, done = terminal_events(job)
    assert deltas == ["w1 ", "w2 ", "w3 "]
    assert isinstance(done, Done)
    assert done.finish_reason == "length"
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (5, 3)
    assert done.total_ms >= done.queued_ms >= 0
    assert done.tokens_per_second > 0


def test_full_queue_refuses_at_once_with_retry_after(worker_for):
    engine = FakeEngine(token_s=0.05)
    worker = worker_for(engine, max_queue=2)
    running = fill_batch(worker, max_tokens=100)
    waiting = [
        worker.submit(Job(ids(f"q{i}"), Sampling(max_tokens=1), timeout_s=30)) for i in range(2)
    ]
    started = time.monotonic()
    with pytest.raises(Overloaded) as refused:
        worker.submit(Job(ids("extra"), Sampling(max_tokens=1), timeout_s=30))
    assert time.monotonic() - started < 0.1
    assert refused.value.retry_after_s > 0
    cancel(running)
    for job in waiting:
        assert isinstance(terminal_events(job)[1], Done)


def test_retry_after_is_the_measured_rest_of_the_running_job(worker_for):
    engine = FakeEngine(token_s=0.05)
    worker = worker_for(engine, max_queue=2)
    assert worker.expected_start_s(0) == 0  # idle: a slot is free now
    done = worker.run_now(ids("warm-up"), Sampling(max_tokens=4))
    measured = (done.total_ms - done.queued_ms) / 1000  # about 0.2 s: replaces the 5 s guess

    running = fill_batch(worker, max_tokens=100)
    for i in range(2):
        worker.submit(Job(ids(f"q{i}"), Sampling(max_tokens=1), timeout_s=30))
    with pytest.raises(Overloaded) as refused:
        worker.submit(Job(ids("extra"), Sampling(max_tokens=1), timeout_s=30))
    assert 0 <= refused.value.retry_after_s <= measured
    time.sleep(measured / 2)  # the oldest running job's elapsed time counts
    assert worker.expected_start_s(0) <= measured / 2 + 0.01
    # Each job ahead adds an average job time over max_batch: that many end per job time.
    ahead = worker.expected_start_s(2) - worker.expected_start_s(0)
    assert ahead == pytest.approx(2 * measured / worker.max_batch, abs=0.02)
    cancel(running)


def test_retry_after_starts_from_a_guess_until_a_job_is_measured(worker_for):
    engine = FakeEngine(token_s=0.05)
    worker = worker_for(engine, max_queue=1)
    running = fill_batch(worker, max_tokens=100)
    waiting = worker.submit(Job(ids("q"), Sampling(max_tokens=1), timeout_s=30))
    with pytest.raises(Overloaded) as refused:
        worker.submit(Job(ids("extra"), Sampling(max_tokens=1), timeout_s=30))
    assert 4 < refused.value.retry_after_s <= 5
    waiting.cancel()
    cancel(running)  # interrupted jobs are not measured
    assert wait_until(lambda: worker.depth == 0 and not worker.busy, 5)
    # Idle, the first job behind a whole batch waits for one job: still the 5 s guess.
    assert worker.expected_start_s(worker.max_batch) == pytest.approx(5)


def test_deadline_passed_in_queue_is_a_timeout_and_never_runs(worker_for):
    engine = FakeEngine(token_s=0.05)
    worker = worker_for(engine)
    blockers = fill_batch(worker, max_tokens=10)
    late = worker.submit(Job(ids("late"), Sampling(max_tokens=5), timeout_s=0.1))
    _, outcome = terminal_events(late)
    assert isinstance(outcome, Failed) and isinstance(outcome.error, Timeout)
    assert all(isinstance(terminal_events(b)[1], Done) for b in blockers)
    assert ids("late") not in engine.ran


def test_deadline_during_generation_stops_it(worker_for):
    engine = FakeEngine(token_s=0.02)
    worker = worker_for(engine)
    job = worker.submit(Job(ids("long"), Sampling(max_tokens=10_000), timeout_s=0.3))
    deltas, outcome = terminal_events(job)
    assert isinstance(outcome, Failed) and isinstance(outcome.error, Timeout)
    assert 0 < len(deltas) < 100


def test_cancel_stops_a_running_job_within_a_couple_of_tokens(worker_for):
    engine = FakeEngine(token_s=0.02)
    worker = worker_for(engine)
    job = worker.submit(Job(ids("long"), Sampling(max_tokens=10_000), timeout_s=30))
    for _ in range(3):
        assert isinstance(job.events.get(timeout=5), Delta)
    job.cancel()
    _, outcome = terminal_events(job)
    assert isinstance(outcome, Failed) and isinstance(outcome.error, Cancelled)
    assert engine.tokens_made[-1] <= 3 + 2


def test_cancelled_while_queued_never_runs(worker_for):
    engine = FakeEngine(token_s=0.02)
    worker = worker_for(engine)
    blockers = fill_batch(worker, max_tokens=10)
    gone = worker.submit(Job(ids("gone"), Sampling(max_tokens=10), timeout_s=30))
    gone.cancel()
    assert all(isinstance(terminal_events(b)[1], Done) for b in blockers)
    assert isinstance(terminal_events(gone)[1].error, Cancelled)
    assert ids("gone") not in engine.ran


def test_dead_waiting_jobs_free_their_slots_at_once(worker_for):
    """A queued job whose client left or whose deadline passed ends and leaves the FIFO at
    once, while the running jobs still run: its slot goes to the next live job."""
    engine = FakeEngine(token_s=0.02)
    worker = worker_for(engine, max_queue=3)
    running = fill_batch(worker)
    first = worker.submit(Job(ids("first"), Sampling(max_tokens=1), timeout_s=30))
    gone = worker.submit(Job(ids("gone"), Sampling(max_tokens=1), timeout_s=30))
    late = worker.submit(Job(ids("late"), Sampling(max_tokens=1), timeout_s=0.2))
    with pytest.raises(Overloaded):
        worker.submit(Job(ids("extra"), Sampling(max_tokens=1), timeout_s=30))
    gone.cancel()
    time.sleep(0.3)  # late's deadline passes
    assert worker.depth == 1  # only `first` still waits for its turn
    assert isinstance(terminal_events(gone, timeout=1)[1].error, Cancelled)
    assert isinstance(terminal_events(late, timeout=1)[1].error, Timeout)
    second = worker.submit(Job(ids("second"), Sampling(max_tokens=1), timeout_s=30))
    third = worker.submit(Job(ids("third"), Sampling(max_tokens=1), timeout_s=30))
    with pytest.raises(Overloaded):  # three live jobs wait: the bound still holds
        worker.submit(Job(ids("extra"), Sampling(max_tokens=1), timeout_s=30))
    # all of that while the batch ran
    assert worker.running == worker.max_batch and not any(r.events.empty() for r in running)
    cancel(running)
    for job in (first, second, third):
        assert isinstance(terminal_events(job)[1], Done)
    assert engine.ran == [job.prompt_ids for job in running] + [
        ids("first"),
        ids("second"),
        ids("third"),
    ]


def test_engine_failure_reaches_its_job_and_the_worker_goes_on(worker_for):
    engine = FakeEngine(token_s=0.001, fail_on="boom")
    worker = worker_for(engine)
    bad = worker.submit(Job(ids("boom"), Sampling(max_tokens=3), timeout_s=30))
    good = worker.submit(Job(ids("fine"), Sampling(max_tokens=3), timeout_s=30))
    _, outcome = terminal_events(bad)
    assert isinstance(outcome, Failed) and isinstance(outcome.error, Internal)
    assert bad.id in outcome.error.message
    assert isinstance(terminal_events(good)[1], Done)
    assert worker.alive


def test_stop_ends_waiting_and_running_jobs(worker_for):
    engine = FakeEngine(token_s=0.02)
    worker = worker_for(engine)
    running = fill_batch(worker)
    waiting = worker.submit(Job(ids("wait"), Sampling(max_tokens=10), timeout_s=30))
    worker.stop()
    assert not worker.alive
    assert all(isinstance(terminal_events(r)[1].error, Unavailable) for r in running)
    assert isinstance(terminal_events(waiting)[1].error, Unavailable)
    with pytest.raises(Unavailable):
        worker.submit(Job(ids("late"), Sampling(max_tokens=1), timeout_s=30))


class DyingEngine(FakeEngine):
    def step(self, streams):
        raise SystemExit("gone")  # not an Exception: nothing in the loop may swallow it


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_dead_thread_ends_its_job_and_refuses_new_ones_at_once(worker_for):
    worker = worker_for(DyingEngine())
    job = worker.submit(Job(ids("x"), Sampling(max_tokens=1), timeout_s=30))
    assert isinstance(terminal_events(job)[1].error, Internal)
    assert wait_until(lambda: not worker.alive, 5)
    with pytest.raises(Unavailable):
        worker.submit(Job(ids("y"), Sampling(max_tokens=1), timeout_s=30))


def test_the_thread_builds_its_own_engine_and_start_reports_failures():
    built_in = []

    def load():
        built_in.append(threading.current_thread().name)
        return FakeEngine(token_s=0.0)

    worker = Worker(None, 2).start(load)
    assert built_in == ["inference"]
    job = worker.submit(Job(ids("x"), Sampling(max_tokens=2), timeout_s=30))
    assert isinstance(terminal_events(job)[1], Done)
    worker.stop()

    def broken():
        raise OSError("weights unreadable")

    with pytest.raises(OSError, match="unreadable"):
        Worker(None, 2).start(broken)
    Worker(None, 2).stop()  # never started: stopping is still safe


def test_the_engine_lets_go_of_its_spares_only_after_a_quiet_while(worker_for):
    engine = FakeEngine(token_s=0.002)
    worker = worker_for(engine)
    worker.idle_tick, worker.idle_release_s = 0.02, 0.3
    assert wait_until(lambda: engine.idled > 0, 5)  # nothing has run yet: idle at once
    job = worker.submit(Job(ids("busy"), Sampling(max_tokens=400), timeout_s=30))
    assert wait_until(lambda: worker.running == 1, 5)
    idled = engine.idled
    time.sleep(0.5)  # longer than the quiet while, but a job is running
    assert engine.idled == idled
    terminal_events(job)
    ended = time.monotonic()
    assert wait_until(lambda: engine.idled > idled, 5)
    assert time.monotonic() - ended >= 0.3 - 0.05
