"""The adaptive thread count: when it changes, and that the answer does not change with it."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time

import pytest
import torch

from inference import threads
from inference.config import load_config
from inference.host import name_this_thread
from inference.jobs import Done, Job, Sampling
from inference.threads import ThreadGovernor, governor_for, thread_waits
from tests.fakes import FakeEngine
from tests.test_worker import ids, terminal_events


class Scripted:
    """A clock and a schedstat that the test moves: each `span()` is one interval in which
    the inference threads ran and waited the given milliseconds."""

    def __init__(self, most: int = 2):
        self.now = 0.0
        self.ran = self.waited = 0
        self.calls: list[int] = []
        self.governor = ThreadGovernor(
            most, self.calls.append, lambda: (self.ran, self.waited), lambda: self.now
        )
        self.governor.tick()  # the first look only takes the baseline

    def span(self, waited_share: float, seconds: float = threads.INTERVAL_S) -> int:
        busy = int(seconds * 1e9)
        self.waited += int(busy * waited_share)
        self.ran += busy - int(busy * waited_share)
        self.now += seconds
        self.governor.tick()
        return self.governor.threads


def test_contention_drops_to_one_thread_and_quiet_brings_all_back():
    s = Scripted(most=2)
    assert s.span(0.02) == 2 and s.calls == []
    assert s.span(0.4) == 1 and s.calls == [1]
    # while others still take the CPUs (one thread waits for a third of its time), stay at one
    for _ in range(10):
        assert s.span(0.33) == 1
    # quiet: back to all threads once PROBE_S has passed quietly
    quiet_spans = [s.span(0.0) for _ in range(int(threads.PROBE_S) + 1)]
    assert quiet_spans[-1] == 2 and quiet_spans[0] == 1 and s.calls == [1, 2]


def test_a_probe_that_meets_contention_at_once_waits_longer_next_time():
    s = Scripted(most=4)

    def quiet_seconds_until_raised() -> int:
        for n in range(1, 200):
            if s.span(0.0) == 4:
                return n
        raise AssertionError("never raised")

    s.span(0.5)
    first = quiet_seconds_until_raised()
    s.span(0.5)  # contention again right after the try: the next wait doubles
    second = quiet_seconds_until_raised()
    s.span(0.5)
    third = quiet_seconds_until_raised()
    assert second > first and third > second
    for _ in range(8):  # ... up to MAX_PROBE_S
        s.span(0.5)
        longest = quiet_seconds_until_raised()
    assert longest <= threads.MAX_PROBE_S + 2
    # contention long after the count went up starts again from PROBE_S
    for _ in range(5):
        s.span(0.0)
    s.span(0.5)
    assert quiet_seconds_until_raised() == first
    assert s.calls[0] == 1 and set(s.calls) == {1, 4}


def test_it_looks_at_most_once_an_interval_and_ignores_sleeping_threads():
    s = Scripted(most=2)
    s.waited += 10**9  # a whole second of waiting, but seen only half an interval later
    s.now += threads.INTERVAL_S / 2
    s.governor.tick()
    assert s.governor.threads == 2
    s.now += threads.INTERVAL_S / 2
    s.governor.tick()
    assert s.governor.threads == 1
    s.now += 30  # the threads slept (no run, no wait): no judgement either way
    s.governor.tick()
    assert s.governor.threads == 1


def test_one_thread_at_most_means_nothing_to_adapt():
    calls = []
    governor = ThreadGovernor(1, calls.append, lambda: (0, 10**12), lambda: time.monotonic())
    governor.tick()
    assert calls == [] and governor.threads == 1


def test_changes_are_logged(caplog):
    caplog.set_level(logging.INFO, logger="deskchat.threads")
    s = Scripted(most=2)
    s.span(0.6)
    assert "inference threads 2 -> 1 (they waited for a CPU 60% of the last 1 s)" in caplog.text


def test_thread_waits_sums_the_named_threads_of_a_task_tree(tmp_path):
    for tid, (comm, stat) in {
        "101": ("deskchat-infer", "5000 300 7"),
        "102": ("deskchat-infer", "2000 100 3"),
        "103": ("waitress-0", "9000 9000 1"),
        "104": ("deskchat-infer", ""),  # ended between the two reads
    }.items():
        (tmp_path / tid).mkdir()
        (tmp_path / tid / "comm").write_text(comm + "\n")
        (tmp_path / tid / "schedstat").write_text(stat + "\n")
    assert thread_waits(tasks=str(tmp_path)) == (7000, 400)


def test_thread_waits_reads_this_process_threads():
    done = threading.Event()

    def busy():
        name_this_thread("deskchat-probe")
        end = time.monotonic() + 0.2
        while time.monotonic() < end:
            pass
        done.wait()

    t = threading.Thread(target=busy)
    t.start()
    time.sleep(0.3)
    ran, waited = thread_waits("deskchat-probe")
    done.set()
    t.join()
    assert ran >= 0.1e9 and waited >= 0
    assert thread_waits("no-such-thread") == (0, 0)


def test_the_worker_paces_every_step(worker_for):
    engine = FakeEngine(token_s=0.001)
    worker = worker_for(engine, max_queue=4, max_batch=2)
    paced = []
    worker.pace = lambda: paced.append(len(engine.batch_sizes))
    jobs = [worker.submit(Job(ids(f"p{i}"), Sampling(max_tokens=5), 30)) for i in range(3)]
    assert all(isinstance(terminal_events(j)[1], Done) for j in jobs)
    assert paced == list(range(len(engine.batch_sizes)))  # once before each step


def test_the_policy_adapts_only_where_the_answer_cannot_change(caplog):
    caplog.set_level(logging.INFO, logger="deskchat.threads")
    for quantize in ("int8", "int8-row", "int4"):
        governor = governor_for("adaptive", quantize, 2)
        assert governor is not None and governor.most == 2
    assert governor_for("fixed", "int8", 2) is None
    assert governor_for("adaptive", "int8", 1) is None
    assert caplog.text == ""
    assert governor_for("adaptive", "none", 2) is None
    assert "kept at 2 threads with quantize=none" in caplog.text


# -- the answer does not depend on the thread count --------------------------------------------


@pytest.fixture(scope="module", params=["int8", "int8-row"])
def engine_and_prompts(request, embedded_dir):
    from inference.loading import ModelChoice, load_model

    config = dataclasses.replace(load_config([], {}), quantize=request.param, threads=2)
    engine, prompts = load_model(ModelChoice(embedded_dir, "embedded"), config, lambda _m: None)
    yield engine, prompts
    torch.set_num_threads(2)


def generate(engine, prompt_ids, counts) -> str:
    """A greedy answer, the thread count taken from `counts` (cycled) before every step."""
    stream = engine.open(prompt_ids, Sampling(max_tokens=32))
    text, step = "", 0
    while stream.finish is None:
        torch.set_num_threads(counts[step % len(counts)])
        engine.step([stream])
        text += stream.take_text()
        step += 1
    engine.close(stream)
    torch.set_num_threads(2)
    return text + stream.take_text()


def test_the_logits_are_the_same_bits_on_one_thread_or_two(engine_and_prompts):
    from inference.decoder import Segment

    engine, prompts = engine_and_prompts
    text = "Summarize: " + "the launch moved to May and two engineers joined. " * 12
    prompt_ids = prompts.encode([{"role": "user", "content": text}])
    logits = []
    for count in (1, 2):
        torch.set_num_threads(count)
        cache = engine.decoder.new_cache(len(prompt_ids))
        logits.append(engine.decoder.forward([Segment(cache, prompt_ids)], every_row=True))
    torch.set_num_threads(2)
    assert torch.equal(logits[0], logits[1])  # float weights differ here (5e-5 on SmolLM2)


def test_the_answer_is_the_same_whatever_the_thread_count(engine_and_prompts):
    engine, prompts = engine_and_prompts
    long_question = "Summarize: " + "the launch moved to May and two engineers joined. " * 12
    for question in ["List three fruits.", "写一个 Python 函数，计算斐波那契数列。", long_question]:
        prompt_ids = prompts.encode([{"role": "user", "content": question}])
        two = generate(engine, prompt_ids, [2])
        assert two
        assert generate(engine, prompt_ids, [1]) == two, question
        assert generate(engine, prompt_ids, [1, 2, 2, 1, 2]) == two, question
