"""Driving real Engines by hand, as the worker would: two engines on one loaded embedded
model (one speculating, one not) and the helpers that ask them, for the exactness tests
(speculation, penalties, logprobs, batching)."""

from __future__ import annotations

import dataclasses

from inference.runtime.engine import Engine
from service.config import load_config


def speculating_and_plain(embedded_dir):
    """(speculating engine, plain engine on the same weights, prompt builder), int8-row."""
    from inference.loading.assemble import ModelChoice, load_model

    config = dataclasses.replace(load_config([], {}), quantize="int8-row")
    assert config.speculate  # the shipped default
    engine, prompts = load_model(ModelChoice(embedded_dir, "embedded"), config, lambda _m: None)
    assert engine.speculate
    plain = Engine(
        engine.model,
        engine.tokenizer,
        engine.name,
        engine.context_tokens,
        engine.eos_ids,
        native=engine.plan.native,
    )
    assert not plain.speculate
    return engine, plain, prompts


def encode(prompts, question: str) -> list[int]:
    return prompts.encode([{"role": "user", "content": question}])


def answer(engine, prompt_ids, sampling) -> tuple[str, object]:
    parts: list[str] = []
    result = engine.run(prompt_ids, sampling, parts.append, lambda: False)
    return "".join(parts), result


def side_by_side(
    engine, jobs: list[tuple[list[int], object]], joins=None, leaves=None
) -> list[tuple[str, tuple]]:
    """Steps (prompt ids, sampling) jobs together, as the worker would: each one's text and
    logprob entries, in job order (one job: the answer alone). `joins[i]`: the step job i
    is opened at (default 0); `leaves[i]`: the step job i is closed at, unfinished."""
    joins, leaves = joins or {}, leaves or {}
    streams: dict[int, object] = {}
    texts, entries = ["" for _ in jobs], [() for _ in jobs]
    step = 0
    while True:
        for i, (prompt_ids, sampling) in enumerate(jobs):
            if joins.get(i, 0) == step:
                streams[i] = engine.open(prompt_ids, sampling)
        for i, stream in list(streams.items()):
            if leaves.get(i) == step:
                engine.close(stream, interrupted=True)
                del streams[i]
        if not streams and step > max(joins.values(), default=0):
            return list(zip(texts, entries, strict=True))
        engine.step(list(streams.values()))
        for i, stream in list(streams.items()):
            assert stream.error is None, stream.error
            if stream.finish is not None:
                engine.close(stream)
                del streams[i]
            texts[i] += stream.take_text()
            entries[i] += stream.take_logprobs()
        step += 1


def batched(engine, jobs, joins=None, leaves=None) -> list[str]:
    """side_by_side's texts alone."""
    return [text for text, _ in side_by_side(engine, jobs, joins, leaves)]
