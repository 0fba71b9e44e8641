"""The adaptive thread count: when it changes, and that the answer does not change with it."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time

import pytest
import torch

from inference.host import threads
from inference.host.process import name_this_thread
from inference.host.threads import ThreadGovernor, governor_for, thread_waits
from inference.runtime.jobs import Done, Job, Sampling
from service.config import load_config, physical_cores
from tests.support.fakes import FakeEngine, ids, terminal_events
from tests.support.httpclient import request


class Scripted:
    """A clock and a schedstat that the test moves: each `span()` is one interval in which
    the first of two inference threads waited the given share of its time, the other none."""

    def __init__(self, most: int = 2):
        self.now = 0.0
        self.totals = {1: [0, 0], 2: [0, 0]}  # tid -> [ns ran, ns waited]
        self.calls: list[int] = []
        self.governor = ThreadGovernor(most, self.calls.append, self.sample, lambda: self.now)
        self.governor.tick()  # the first look only takes the baseline

    def sample(self):
        return {tid: (ran, waited) for tid, (ran, waited) in self.totals.items()}

    def span(self, waited_share: float, seconds: float = threads.INTERVAL_S) -> int:
        busy = int(seconds * 1e9)
        first, *others = self.totals
        self.totals[first][0] += busy - int(busy * waited_share)
        self.totals[first][1] += int(busy * waited_share)
        for tid in others:
            self.totals[tid][0] += busy
        self.now += seconds
        self.governor.tick()
        return self.governor.threads


def quiet_spans_until_raised(s: Scripted) -> int:
    for n in range(1, 200):
        if s.span(0.0) == s.governor.most:
            return n
    raise AssertionError("never raised")


def test_contention_drops_to_one_thread_and_quiet_brings_all_back():
    s = Scripted(most=2)
    assert s.span(0.02) == 2 and s.calls == []
    assert s.span(0.4) == 1 and s.calls == [1]  # one thread waiting is enough
    for _ in range(10):  # others still take the CPUs (one thread waits a third): stay at one
        assert s.span(0.33) == 1
    assert quiet_spans_until_raised(s) == threads.PROBE_S / threads.INTERVAL_S
    assert s.calls == [1, 2]


def test_a_probe_that_meets_contention_at_once_waits_longer_next_time():
    s = Scripted(most=4)
    s.span(0.5)
    waits = [quiet_spans_until_raised(s)]
    for _ in range(8):
        s.span(0.5)  # contention again at the first look after the try
        waits.append(quiet_spans_until_raised(s))
    assert waits == [4, 8, 16, 32, 64, 64, 64, 64, 64]  # doubling, up to MAX_PROBE_S
    # contention that comes back later (not at the first look) starts again from PROBE_S
    for _ in range(3):
        s.span(0.0)
    s.span(0.5)
    assert quiet_spans_until_raised(s) == 4
    assert s.calls[0] == 1 and set(s.calls) == {1, 4}


def test_it_looks_at_most_once_an_interval_and_does_not_judge_sleep():
    s = Scripted(most=2)
    s.totals[1][1] += 10**9  # a whole second of waiting, but seen only once an interval passed
    s.now += threads.INTERVAL_S / 2
    s.governor.tick()
    assert s.governor.threads == 2
    s.now += threads.INTERVAL_S / 2
    s.governor.tick()
    assert s.governor.threads == 1
    s.span(0.0)  # one quiet second on one thread ...
    s.now += 600  # ... then ten idle minutes: neither contention nor quiet time
    s.governor.tick()
    assert s.governor.threads == 1
    assert quiet_spans_until_raised(s) == threads.PROBE_S / threads.INTERVAL_S


def test_threads_that_come_and_go_count_from_their_own_start():
    s = Scripted(most=2)
    s.totals = {7: [10**12, 10**12]}  # an old thread gone, a new one with a long past
    s.span(0.0)
    assert s.governor.threads == 2  # its past is not this second's waiting
    s.span(0.0)
    assert s.governor.threads == 2 and s.calls == []


def test_a_failed_look_skips_the_look_not_the_step():
    def broken():
        raise OSError(24, "Too many open files")

    governor = ThreadGovernor(2, lambda n: None, broken, lambda: 5.0)
    governor.tick()
    assert governor.threads == 2


def test_changes_are_logged(caplog):
    caplog.set_level(logging.INFO, logger="deskchat.threads")
    s = Scripted(most=2)
    s.span(0.6)
    assert (
        "inference threads 2 -> 1 (the most a thread waited for a CPU: 60% of the last 1.0 s)"
        in caplog.text
    )


def test_thread_waits_reads_each_named_thread_of_a_task_tree(tmp_path):
    for tid, (comm, stat) in {
        "101": ("deskchat-infer", "5000 300 7"),
        "102": ("deskchat-infer", "2000 100 3"),
        "103": ("waitress-0", "9000 9000 1"),
        "104": ("deskchat-infer", ""),  # ended between the two reads
    }.items():
        (tmp_path / tid).mkdir()
        (tmp_path / tid / "comm").write_text(comm + "\n")
        (tmp_path / tid / "schedstat").write_text(stat + "\n")
    assert thread_waits(tasks=str(tmp_path)) == {101: (5000, 300), 102: (2000, 100)}


def test_thread_waits_reads_this_process_threads():
    spun, done = threading.Event(), threading.Event()

    def busy():
        name_this_thread("deskchat-probe")
        start = time.thread_time()
        while time.thread_time() - start < 0.15:
            pass
        spun.set()
        done.wait()

    t = threading.Thread(target=busy)
    t.start()
    assert spun.wait(30)
    found = thread_waits("deskchat-probe")
    done.set()
    t.join()
    assert len(found) == 1
    [(ran, _waited)] = found.values()
    assert ran >= 0.15e9
    assert thread_waits("no-such-thread") == {}


def test_the_worker_paces_every_step(worker_for):
    engine = FakeEngine(token_s=0.001)
    worker = worker_for(engine)
    paced = []
    worker.pace = lambda: paced.append(len(engine.batch_sizes))
    jobs = [worker.submit(Job(ids(f"p{i}"), Sampling(max_tokens=5), 30)) for i in range(3)]
    assert all(isinstance(terminal_events(j)[1], Done) for j in jobs)
    assert paced == list(range(len(engine.batch_sizes)))  # once before each step


def test_the_policy_adapts_only_where_the_answer_cannot_change(caplog):
    caplog.set_level(logging.INFO, logger="deskchat.threads")
    for quantize in ("int8", "int8-row"):
        governor = governor_for("adaptive", quantize, 2)
        assert governor is not None and governor.most == 2
    assert governor_for("fixed", "int8", 2) is None
    assert governor_for("adaptive", "int8", 1) is None
    assert "kept at" not in caplog.text
    for quantize in ("none", "int4"):
        assert governor_for("adaptive", quantize, 2) is None
        assert f"kept at 2 threads (quantize={quantize} changes in the last bits" in caplog.text


def test_the_server_adapts_by_default(embedded_server):
    adapting = physical_cores() > 1  # one core: nothing to adapt, and nothing said
    assert ("inference threads: adaptive" in embedded_server.log()) == adapting
    reply = request(embedded_server.url, "GET", "/metrics")
    assert reply.status == 200 and b"deskchat_inference_threads " in reply.body


@contextlib.contextmanager
def thread_count(count: int):
    """torch's thread count in this thread for a while, then back to what it was."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="module", params=sorted(threads.THREAD_INVARIANT))
def engine_and_prompts(request, embedded_dir):
    from inference.loading.assemble import ModelChoice, load_model

    config = dataclasses.replace(load_config([], {}), quantize=request.param, threads=2)
    with thread_count(2):  # load_model sets the count for the process
        return load_model(ModelChoice(embedded_dir, "embedded"), config, lambda _m: None)


def generate(engine, prompt_ids, counts) -> str:
    """A greedy answer, the thread count taken from `counts` (cycled) for every step."""
    stream = engine.open(prompt_ids, Sampling(max_tokens=32))
    text, step = "", 0
    while stream.finish is None:
        with thread_count(counts[step % len(counts)]):
            engine.step([stream])
        text += stream.take_text()
        step += 1
    engine.close(stream)
    return text + stream.take_text()


@pytest.mark.slow
def test_the_logits_are_the_same_bits_on_one_thread_or_two(engine_and_prompts):
    from inference.model.decoder import Segment

    engine, prompts = engine_and_prompts
    text = "Summarize: " + "the launch moved to May and two engineers joined. " * 12
    prompt_ids = prompts.encode([{"role": "user", "content": text}])
    logits = []
    for count in (1, 2):
        with thread_count(count):
            cache = engine.decoder.new_cache(len(prompt_ids))
            logits.append(engine.decoder.forward([Segment(cache, prompt_ids)], every_row=True))
    assert torch.equal(logits[0], logits[1])  # not so with float weights: THREAD_INVARIANT


@pytest.mark.slow
def test_the_answer_is_the_same_whatever_the_thread_count(engine_and_prompts):
    engine, prompts = engine_and_prompts
    long_question = "Summarize: " + "the launch moved to May and two engineers joined. " * 12
    for question in ["List three fruits.", "写一个 Python 函数，计算斐波那契数列。", long_question]:
        prompt_ids = prompts.encode([{"role": "user", "content": question}])
        two = generate(engine, prompt_ids, [2])
        assert two
        assert generate(engine, prompt_ids, [1]) == two, question
        assert generate(engine, prompt_ids, [1, 2, 2, 1, 2]) == two, question
