"""Prompt-prefix KV reuse: the next turn of a conversation runs only its new suffix, and its
greedy answer is exactly what a fresh run of the whole prompt gives."""

from __future__ import annotations

import dataclasses

import pytest

from inference.runtime.engine import PREFILL_BLOCK
from inference.runtime.jobs import Sampling
from service.config import load_config

pytestmark = pytest.mark.slow  # two model loads and three-turn conversations on each

TURNS = [
    "What is the capital of France?",
    "And which river flows through it?",
    "Name one famous museum there.",
]


@pytest.fixture(scope="module", params=["int8", "none"])
def engine_and_prompts(request, embedded_dir):
    """An engine with prefix_cache on; `engine.fresh()` answers as if nothing were kept."""
    from inference.loading.assemble import ModelChoice, load_model

    path = embedded_dir
    config = dataclasses.replace(
        load_config([], {}), quantize=request.param, prefix_cache=True, threads=2
    )
    return load_model(ModelChoice(path, "embedded"), config, lambda _m: None)


def answer(engine, ids) -> str:
    parts: list[str] = []
    engine.run(ids, Sampling(max_tokens=24), parts.append, lambda: False)
    return "".join(parts)


def test_follow_up_turns_reuse_the_cache_and_answer_the_same(engine_and_prompts):
    engine, prompts = engine_and_prompts
    messages: list[dict] = []
    for turn, question in enumerate(TURNS):
        messages.append({"role": "user", "content": question})
        ids = prompts.encode(messages)
        reused = answer(engine, ids)
        reused_tokens = engine.reused_tokens
        engine._kept = None  # forget: the whole prompt runs again
        fresh = answer(engine, ids)
        assert reused == fresh
        if turn > 0:
            # the previous prompt, down to a whole prefill block, came from the cache
            previous = len(prompts.encode(messages[:-2]))
            assert reused_tokens == previous // PREFILL_BLOCK * PREFILL_BLOCK > 0
        messages.append({"role": "assistant", "content": reused})


def test_an_unrelated_prompt_starts_from_the_shared_prefix_only(engine_and_prompts):
    engine, prompts = engine_and_prompts
    first = prompts.encode([{"role": "user", "content": "Tell me a joke."}])
    answer(engine, first)
    other = prompts.encode([{"role": "user", "content": "What is 2 plus 2?"}])
    shared = next(i for i, (a, b) in enumerate(zip(first, other, strict=False)) if a != b)
    got = answer(engine, other)
    assert engine.reused_tokens == shared // PREFILL_BLOCK * PREFILL_BLOCK
    engine._kept = None
    assert got == answer(engine, other)


def test_the_same_prompt_twice_reruns_only_its_last_block(engine_and_prompts):
    engine, prompts = engine_and_prompts
    ids = prompts.encode([{"role": "user", "content": "Say hello."}])
    first = answer(engine, ids)
    assert answer(engine, ids) == first
    assert engine.reused_tokens == (len(ids) - 1) // PREFILL_BLOCK * PREFILL_BLOCK
