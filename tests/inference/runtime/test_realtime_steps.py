"""The worker raises the inference threads to real time around a request's short first step
only (--realtime-first-step-ms, inference/host/realtime.py): the real embedded model in the
real worker, each step's thread scheduling read inside the step."""

from __future__ import annotations

import os

import pytest

from inference.host.process import name_this_thread, sched_attr
from inference.host.realtime import PRIORITY, RealtimeFirstStep
from inference.runtime.jobs import Sampling
from inference.runtime.worker import Worker
from service.config import load_config
from tests.support.engines import encode

BOUND_MS = 50


@pytest.fixture(scope="module")
def stepping(embedded_dir):
    """(worker, realtime, prompts, steps): `steps` gets, for every step, whether a stream in
    it was prefilling and each inference thread's (policy, priority) during the step."""
    from inference.loading.assemble import ModelChoice, load_model

    config = load_config(["--threads", "2"], {})
    realtime = RealtimeFirstStep(BOUND_MS, config.sched_slice_us)
    loaded = {}

    def load():
        name_this_thread()
        engine, loaded["prompts"] = load_model(
            ModelChoice(embedded_dir, "embedded"), config, lambda _m: None
        )
        engine.set_threads(2)
        realtime.check()
        return engine

    worker = Worker(None, 4, realtime=realtime).start(load)
    steps: list[tuple[bool, list[tuple[int, int]]]] = []
    real_step = worker.engine.step

    def step(streams):
        policies = [sched_attr(tid)[::3][:2] for tid in realtime.threads()]  # policy, priority
        steps.append((any(s.prefilling for s in streams), policies))
        real_step(streams)

    worker.engine.step = step
    yield worker, realtime, loaded["prompts"], steps
    worker.stop()


def _run(worker, prompt_ids, tokens: int) -> None:
    done = worker.run_now(prompt_ids, Sampling(max_tokens=tokens))
    assert done.usage.completion_tokens == tokens, done  # a greedy "length" answer


FIFO = (os.SCHED_FIFO, PRIORITY)


def test_a_short_first_step_runs_real_time_and_the_rest_do_not(stepping) -> None:
    worker, realtime, prompts, steps = stepping
    assert realtime.on  # root, or CAP_SYS_NICE: the tests run with the privilege
    question = encode(prompts, "Name three colours.")
    _run(worker, question, 4)  # nothing measured before this one: none of its steps raised
    first = list(steps)
    assert first and all(FIFO not in policies for _, policies in first), first
    steps.clear()
    _run(worker, question, 12)
    prefills = [policies for prefilling, policies in steps if prefilling]
    later = [policies for prefilling, policies in steps if not prefilling]
    assert len(prefills) == 1 and len(later) >= 3, steps
    assert len(prefills[0]) >= 2 and set(prefills[0]) == {FIFO}, steps  # thread and pool
    assert all(FIFO not in policies for policies in later), steps
    after = [sched_attr(tid) for tid in realtime.threads()]
    assert {(a.policy, a.priority) for a in after} == {(os.SCHED_OTHER, 0)}, after


def test_a_prompt_expected_longer_than_the_bound_never_runs_real_time(stepping) -> None:
    worker, realtime, prompts, steps = stepping
    _run(worker, encode(prompts, "Name three colours."), 2)  # measured, whatever ran before
    long = encode(prompts, "Summarize: " + "the quick brown fox jumps over a lazy dog. " * 60)
    streams = [worker.engine.open(long, Sampling(max_tokens=1))]
    expected = worker.engine.prefill_step_s(streams)
    worker.engine.close(streams[0], interrupted=True)
    assert expected > BOUND_MS / 1000, expected  # the premise: several hundred rows
    steps.clear()
    _run(worker, long, 3)
    assert sum(prefilling for prefilling, _ in steps) >= 2, steps  # chunks: several steps
    assert all(FIFO not in policies for _, policies in steps), steps
