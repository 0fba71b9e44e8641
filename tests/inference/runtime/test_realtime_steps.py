"""The worker raises the inference threads to real time around a request's short first step
only (--realtime-first-step-ms, inference/host/realtime.py): the real embedded model in the
real worker, each step's thread scheduling read inside the step."""

from __future__ import annotations

import os
from typing import NamedTuple

import pytest

from inference.host.process import name_this_thread, sched_attr
from inference.host.realtime import PRIORITY, RealtimeFirstStep
from inference.runtime.jobs import Sampling
from inference.runtime.worker import Worker
from service.config import load_config
from tests.support.engines import encode

BOUND_MS = 50


class Step(NamedTuple):
    prefilling: bool  # a stream in it was still computing its prompt
    expected_s: float | None  # the engine's estimate the worker went by
    policies: list[tuple[int, int]]  # each inference thread's (policy, priority) inside it


@pytest.fixture(scope="module")
def stepping(embedded_dir):
    """(worker, realtime, prompts, steps): `steps` gets a Step for every step."""
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
    steps: list[Step] = []
    engine = worker.engine
    real_step = engine.step

    def step(streams):
        policies = [(a.policy, a.priority) for a in map(sched_attr, realtime.threads())]
        prefilling = any(s.prefilling for s in streams)
        steps.append(Step(prefilling, engine.prefill_step_s(streams), policies))
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
    assert first and all(FIFO not in step.policies for step in first), first
    steps.clear()
    _run(worker, question, 12)
    prefills = [step for step in steps if step.prefilling]
    later = [step for step in steps if not step.prefilling]
    assert len(prefills) == 1 and len(later) >= 3, steps
    assert len(prefills[0].policies) >= 2, steps  # the thread and its pool
    assert set(prefills[0].policies) == {FIFO}, steps
    assert all(FIFO not in step.policies for step in later), steps
    after = [sched_attr(tid) for tid in realtime.threads()]
    assert {(a.policy, a.priority) for a in after} == {(os.SCHED_OTHER, 0)}, after


def test_a_long_prompt_runs_real_time_only_once_its_rest_fits_the_bound(stepping) -> None:
    """Its chunks while the rest of it is expected to take longer run as before; once the
    rest fits (its last chunk, here), the step is raised: at most about the bound of real
    time per request."""
    worker, realtime, prompts, steps = stepping
    _run(worker, encode(prompts, "Name three colours."), 2)  # measured, whatever ran before
    long = encode(prompts, "Summarize: " + "the quick brown fox jumps over a lazy dog. " * 60)
    steps.clear()
    _run(worker, long, 3)
    prefills = [step for step in steps if step.prefilling]
    assert len(prefills) >= 2, steps  # several chunks
    assert prefills[0].expected_s > BOUND_MS / 1000, prefills[0]  # the premise
    for step in steps:
        raised = step.expected_s is not None and step.expected_s <= BOUND_MS / 1000
        assert (FIFO in step.policies) == raised, step
        assert set(step.policies) in ({FIFO}, {(os.SCHED_OTHER, 0)}), step  # all, or none
