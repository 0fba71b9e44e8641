"""The shared prefix cache through the real engine: a follow-up turn, a second conversation
beside the first and a repeated system prompt run only what no earlier stream computed, and
every answer is exactly what a fresh run of the whole prompt gives, alone, in a full batch
and with speculation, on the per-row weights (native step) and on torch's int8 and float."""

from __future__ import annotations

import dataclasses

import pytest

from inference.runtime.jobs import Sampling
from service.config import load_config
from tests.support.engines import batched

pytestmark = pytest.mark.slow  # three model loads and multi-turn conversations on each

TURNS = [
    "What is the capital of France?",
    "And which river flows through it?",
    "Name one famous museum there.",
]
SYSTEM = "You are the help desk of a small office. " * 12
GREEDY = Sampling(max_tokens=24)


@pytest.fixture(scope="module", params=["int8-row", "int8", "none"])
def engine_and_prompts(request, embedded_dir):
    from inference.loading.assemble import ModelChoice, load_model

    config = dataclasses.replace(load_config([], {}), quantize=request.param, threads=2)
    assert config.prefix_cache  # the shipped default
    engine, prompts = load_model(ModelChoice(embedded_dir, "embedded"), config, lambda _m: None)
    assert engine.prefixes is not None
    assert engine.batch_invariant == (request.param == "int8-row")
    return engine, prompts


def answer(engine, ids, sampling=GREEDY) -> str:
    parts: list[str] = []
    engine.run(ids, sampling, parts.append, lambda: False)
    return "".join(parts)


def reusable(engine, shared: int) -> int:
    """What the cache gives of `shared` cached prompt tokens: all of them where a prefix may
    end inside a block (the native step), else its whole blocks."""
    block = engine.prefixes.block
    return shared if engine.prefixes.partial else shared // block * block


def fresh(engine, ids, sampling=GREEDY) -> str:
    """The answer with nothing cached: the whole prompt runs."""
    engine.prefixes.clear()
    got = answer(engine, ids, sampling)
    assert engine.reused_tokens == 0
    return got


def test_follow_up_turns_reuse_the_cache_and_answer_the_same(engine_and_prompts):
    engine, prompts = engine_and_prompts
    engine.prefixes.clear()
    block = engine.prefixes.block
    messages: list[dict] = [{"role": "system", "content": SYSTEM}]
    for turn, question in enumerate(TURNS):
        messages.append({"role": "user", "content": question})
        ids = prompts.encode(messages)
        reused = answer(engine, ids)
        reused_tokens = engine.reused_tokens
        if turn > 0:
            # at least the previous prompt, in whole blocks; on per-row weights the
            # previous answer's rows too, as far as the tokens agree
            previous = len(prompts.encode(messages[:-2]))
            assert reused_tokens >= previous // block * block > 0
            if engine.prefixes.partial:  # all of it, and of the answer as far as it agrees
                assert reused_tokens > previous
            if not engine.batch_invariant:
                assert reused_tokens == previous // block * block
        assert reused == fresh(engine, ids)
        messages.append({"role": "assistant", "content": reused})


def test_two_conversations_and_a_shared_system_prompt(engine_and_prompts):
    engine, prompts = engine_and_prompts
    engine.prefixes.clear()
    block = engine.prefixes.block
    system = {"role": "system", "content": SYSTEM}
    first = [system, {"role": "user", "content": TURNS[0]}]
    second = [system, {"role": "user", "content": "How do I book a meeting room?"}]
    first_answer = answer(engine, prompts.encode(first))
    second_ids = prompts.encode(second)
    pairs = zip(prompts.encode(first), second_ids, strict=False)
    shared = next(i for i, (a, b) in enumerate(pairs) if a != b)
    second_answer = answer(engine, second_ids)  # the system prompt came from the first
    assert engine.reused_tokens == reusable(engine, shared) > 0
    # the first conversation goes on after the second: its own history is still there
    follow = [*first, {"role": "assistant", "content": first_answer}]
    follow.append({"role": "user", "content": TURNS[1]})
    follow_ids = prompts.encode(follow)
    got = answer(engine, follow_ids)
    assert engine.reused_tokens >= len(prompts.encode(first)) // block * block
    assert got == fresh(engine, follow_ids)
    assert second_answer == fresh(engine, second_ids)


def test_the_same_prompt_twice_reruns_only_its_end(engine_and_prompts):
    engine, prompts = engine_and_prompts
    assert engine.prefixes.partial == (engine.decode_step != "torch")
    system = {"role": "system", "content": SYSTEM}
    ids = prompts.encode([system, {"role": "user", "content": "Hi."}])
    first = fresh(engine, ids)
    assert answer(engine, ids) == first
    assert engine.reused_tokens == reusable(engine, len(ids) - 1)  # the last token runs


def test_a_prefix_that_ends_inside_a_block(engine_and_prompts):
    """Two questions after one system prompt part their ways inside a block: the second
    takes every shared token (native) and answers as a fresh run does, at any chunking."""
    engine, prompts = engine_and_prompts
    engine.prefixes.clear()
    system = {"role": "system", "content": SYSTEM}
    first = prompts.encode([system, {"role": "user", "content": TURNS[0]}])
    second = prompts.encode([system, {"role": "user", "content": TURNS[2]}])
    shared = next(i for i, (a, b) in enumerate(zip(first, second, strict=False)) if a != b)
    assert shared % engine.prefixes.block  # they part inside a block
    expected = fresh(engine, second)
    engine.prefixes.clear()
    answer(engine, first)
    assert engine.prefixes.cached_tokens(second) == reusable(engine, shared)
    assert answer(engine, second) == expected
    assert engine.reused_tokens == reusable(engine, shared)


def test_a_kept_cache_buffer_answers_as_a_new_one(engine_and_prompts):
    """A finished job's buffer serves the next job (kvcache.SpareBuffers) with whatever the
    last one left in it, here poison: nothing past what the job itself wrote is read, with
    the whole prompt computed or its prefix restored from the cache."""
    engine, prompts = engine_and_prompts
    spares = engine.decoder.spares
    ids = prompts.encode(
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TURNS[1]}]
    )
    spares.clear()
    expected = fresh(engine, ids)  # into a new buffer, kept when the job ends
    assert len(spares) == 1
    for keep_prefix in (False, True):
        kept = spares.buffers[0]
        kept.fill_(float("nan"))
        got = answer(engine, ids) if keep_prefix else fresh(engine, ids)
        assert engine.reused_tokens == (reusable(engine, len(ids) - 1) if keep_prefix else 0)
        assert spares.buffers[0].data_ptr() == kept.data_ptr()  # it served, and came back
        assert got == expected
    engine.idle()  # the worker's quiet while: the kept buffers go
    assert len(spares) == 0


def test_cached_prefixes_in_a_full_batch_with_speculation(engine_and_prompts):
    engine, prompts = engine_and_prompts
    if not engine.batch_invariant:
        pytest.skip("torch's int8 and float steps run one job at a time, without drafts")
    assert engine.speculate  # the shipped default
    system = {"role": "system", "content": SYSTEM}
    jobs = [
        (prompts.encode([system, {"role": "user", "content": q}]), GREEDY)
        for q in [*TURNS, "Repeat after me: the printer on floor two is out of toner."]
    ]
    expected = [fresh(engine, ids) for ids, _ in jobs]
    engine.prefixes.clear()
    answer(engine, jobs[0][0])  # the system prompt is cached now
    assert batched(engine, jobs) == expected  # every job starts from the cached prefix
    assert batched(engine, jobs, joins={1: 2, 3: 4}) == expected
