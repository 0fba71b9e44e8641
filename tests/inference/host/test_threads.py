"""The measured thread count: when it changes, and that the answer does not change with it."""

from __future__ import annotations

import contextlib
import dataclasses
import logging

import pytest
import torch

from inference.host import threads
from inference.host.threads import ThreadGovernor, governor_for
from inference.runtime.jobs import Done, Job, Sampling
from service.config import load_config, physical_cores
from tests.support.fakes import FakeEngine, ids, terminal_events
from tests.support.httpclient import request


class Scripted:
    """A governor over steps whose forward takes `step_s[threads]` seconds of a fake clock,
    `rows` rows each."""

    def __init__(self, step_s: dict[int, float], most: int = 2):
        self.now = 0.0
        self.step_s = step_s
        self.calls: list[int] = []
        self.running = most
        self.governor = ThreadGovernor(most, self.set_threads, lambda: self.now)
        self.governor.tick(None)  # before the first step: nothing measured yet

    def set_threads(self, count: int) -> None:
        self.calls.append(count)
        self.running = count

    def steps(self, n: int, rows: int = 1) -> list[int]:
        """n steps; the thread count each ran on."""
        ran = []
        for _ in range(n):
            seconds = self.step_s[self.running]
            ran.append(self.running)
            self.now += seconds
            self.governor.tick((rows, seconds))
        return ran


def probes(ran: list[int], serving: int) -> list[int]:
    """The step indices at which a run of steps on another count than `serving` began."""
    return [i for i, t in enumerate(ran) if t != serving and (i == 0 or ran[i - 1] == serving)]


def test_two_threads_keep_serving_while_they_measure_faster():
    s = Scripted({2: 0.010, 1: 0.017})
    ran = s.steps(20_000)
    assert s.governor.threads == 2 and s.governor.changes == 0
    assert set(s.calls) == {1, 2}  # it tried one thread now and then, and came back
    # a probe after PROBE_S seconds of steps, then waits doubling up to MAX_PROBE_S
    starts = probes(ran, 2)
    gaps = [b - a for a, b in zip(starts, starts[1:], strict=False)]
    assert starts[0] == threads.PROBE_S / 0.010
    assert [round(gap * 0.010) for gap in gaps[:6]] == [4, 8, 16, 32, 32, 32]
    # on a quiet PC the probes' slower steps are few: far under 1% of them (gap p99)
    assert ran.count(1) < 0.005 * len(ran)


def test_one_thread_serves_when_it_measures_faster_and_two_again_when_they_do():
    s = Scripted({2: 0.020, 1: 0.012})  # others keep the CPUs busy
    s.steps(int(threads.PROBE_S / 0.020) + threads.PROBE_STEPS)
    assert s.governor.threads == 1 and s.calls == [1]
    s.step_s = {2: 0.010, 1: 0.017}  # the others stopped
    s.steps(2000)
    assert s.governor.threads == 2 and s.governor.changes == 2


def test_a_margin_under_ten_percent_changes_nothing():
    s = Scripted({2: 0.010, 1: 0.0095})
    s.steps(5000)
    assert s.governor.threads == 2 and s.governor.changes == 0


def test_steps_of_another_size_or_long_ago_are_not_compared():
    s = Scripted({2: 0.020, 1: 0.012})
    s.steps(int(threads.PROBE_S / 0.020), rows=32)  # prompt chunks beside answers ...
    assert s.steps(threads.PROBE_STEPS, rows=1) == [1] * threads.PROBE_STEPS  # ... a probe
    assert s.governor.threads == 2  # nothing of their size to compare with
    s.steps(int(threads.PROBE_S / 0.020))  # single rows on two threads, then a probe ...
    s.now += threads.RECENT_S + 1  # ... whose own two-thread steps are long past
    s.steps(threads.PROBE_STEPS)
    assert s.governor.threads == 2 and s.governor.changes == 0


def test_a_prompts_big_chunks_run_on_every_thread_and_end_a_probe():
    s = Scripted({2: 0.020, 1: 0.012})  # a busy PC: one thread serves the decode steps
    s.steps(int(threads.PROBE_S / 0.020) + threads.PROBE_STEPS)
    assert s.governor.threads == 1
    big = threads.LARGE_ROWS
    assert s.steps(5, rows=big) == [1, 2, 2, 2, 2]  # a long prompt: after its first chunk
    assert s.steps(3) == [2, 1, 1]  # answering again: one thread, after one step
    assert s.governor.threads == 1 and s.governor.changes == 1
    quiet = Scripted({2: 0.010, 1: 0.017})
    quiet.steps(int(threads.PROBE_S / 0.010))  # up to a probe on one thread ...
    assert quiet.steps(4, rows=big) == [1, 2, 2, 2]  # ... which a prompt's chunk ends
    assert quiet.steps(3, rows=big - 1) == [2, 1, 1]  # a probe again, of smaller steps
    assert quiet.governor.changes == 0


def test_a_first_tokens_step_is_never_a_probes():
    """A request waiting for its answer to begin runs on the serving count; the probe it
    interrupts begins again after it, its wake-up step not counted."""
    s = Scripted({2: 1 / 64, 1: 1 / 32})  # exact in binary: the probe is due at step 129
    last = [None]

    def step(first_token: bool) -> int:
        """The worker's order: a tick saying what the step gives, then the step."""
        s.governor.tick(last[0], first_token)
        ran = s.running
        s.now += s.step_s[ran]
        last[0] = (1, s.step_s[ran])
        return ran

    assert {step(False) for _ in range(int(threads.PROBE_S * 64))} == {2}  # then it is due
    assert [step(f) for f in (True, False, False, True, False)] == [2, 1, 1, 2, 1]
    steps = [step(False) for _ in range(threads.PROBE_STEPS)]
    assert steps == [1] * (threads.PROBE_STEPS - 1) + [2]  # a whole probe after the last
    assert s.governor.threads == 2 and s.governor.changes == 0


def test_idle_time_does_not_bring_a_probe():
    s = Scripted({2: 0.010, 1: 0.017})
    s.steps(int(threads.PROBE_S / 0.010) - 5)
    s.now += 3600  # an hour without a request
    assert s.steps(4) == [2, 2, 2, 2]


def test_changes_are_logged(caplog):
    caplog.set_level(logging.INFO, logger="deskchat.threads")
    s = Scripted({2: 0.020, 1: 0.012})
    s.steps(int(threads.PROBE_S / 0.020) + threads.PROBE_STEPS)
    assert "inference threads 2 -> 1 (steps of 1+ rows: 12.0 ms against 20.0 ms)" in caplog.text


def test_the_worker_paces_every_step(worker_for):
    engine = FakeEngine(token_s=0.001)
    worker = worker_for(engine)
    paced = []
    worker.pace = lambda last, first: paced.append((len(engine.batch_sizes), last, first))
    jobs = [worker.submit(Job(ids(f"p{i}"), Sampling(max_tokens=5), 30)) for i in range(3)]
    assert all(isinstance(terminal_events(j)[1], Done) for j in jobs)
    assert [n for n, _last, _first in paced] == list(range(len(engine.batch_sizes)))  # each
    rows, seconds = paced[-1][1]  # with the forward of the step before
    assert rows == engine.batch_sizes[-2] and seconds >= 0.001
    assert paced[0][2] and not paced[-1][2]  # the first step gives a first token, the last not


def test_the_policy_adapts_only_where_the_answer_cannot_change(caplog):
    caplog.set_level(logging.INFO, logger="deskchat.threads")
    for quantize in ("int8", "int8-row"):
        governor = governor_for("adaptive", quantize, 2)
        assert governor is not None and governor.most == 2
    assert governor_for("fixed", "int8", 2) is None
    assert governor_for("adaptive", "int8", 1) is None
    assert "kept at" not in caplog.text
    assert "whichever measures faster" in caplog.text
    for quantize in ("none", "int4"):
        assert governor_for("adaptive", quantize, 2) is None
        assert f"kept at 2 threads (quantize={quantize} changes in the last bits" in caplog.text


def test_the_count_goes_where_the_server_says(engine_and_prompts, keep_threads):
    """governor_for's `set_threads` gets each count (the server passes the engine's); the
    engine gives it to the native step's pool, and torch's ops beside it stay on one."""
    engine, _prompts = engine_and_prompts
    got = []
    governor = governor_for(
        "adaptive", "int8-row", 2, lambda n: (got.append(n), engine.set_threads(n))
    )
    stepped = 0.0
    while not got:  # the first probe runs on the other count
        governor.tick((1, 0.01))
        stepped += 0.01
        assert stepped < 10 * threads.PROBE_S
    assert got == [1]
    native = engine.decoder._native
    if native is not None:
        assert native.threads == 1 and torch.get_num_threads() == 1
        engine.set_threads(2)
        assert native.threads == 2 and torch.get_num_threads() == 1
    else:  # torch's step: its own count
        assert torch.get_num_threads() == 1
        engine.set_threads(2)
        assert torch.get_num_threads() == 2


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
        engine.set_threads(counts[step % len(counts)])  # as the governor sets it
        engine.step([stream])
        text += stream.take_text()
        step += 1
    engine.close(stream)
    return text + stream.take_text()


@pytest.mark.slow
def test_the_logits_are_the_same_bits_on_one_thread_or_two(engine_and_prompts, keep_threads):
    from inference.model.decoder import Segment

    engine, prompts = engine_and_prompts
    text = "Summarize: " + "the launch moved to May and two engineers joined. " * 12
    prompt_ids = prompts.encode([{"role": "user", "content": text}])
    logits = []
    for count in (1, 2):
        engine.set_threads(count)
        cache = engine.decoder.new_cache(len(prompt_ids))
        logits.append(engine.decoder.forward([Segment(cache, prompt_ids)], every_row=True))
    engine.set_threads(2)
    assert torch.equal(logits[0], logits[1])  # not so with float weights: THREAD_INVARIANT


@pytest.mark.slow
def test_the_answer_is_the_same_whatever_the_thread_count(engine_and_prompts, keep_threads):
    engine, prompts = engine_and_prompts
    long_question = "Summarize: " + "the launch moved to May and two engineers joined. " * 12
    for question in ["List three fruits.", "写一个 Python 函数，计算斐波那契数列。", long_question]:
        prompt_ids = prompts.encode([{"role": "user", "content": question}])
        two = generate(engine, prompt_ids, [2])
        assert two
        assert generate(engine, prompt_ids, [1]) == two, question
        assert generate(engine, prompt_ids, [1, 2, 2, 1, 2]) == two, question
