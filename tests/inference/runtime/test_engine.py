"""The lean decode loop against transformers' own generate(), on the real embedded model."""

from __future__ import annotations

import pytest
import torch

from inference.loading.assemble import ModelChoice, load_model
from inference.loading.embedded import EMBEDDED_NAME
from inference.runtime.engine import PREFILL_CHUNK
from inference.runtime.jobs import Sampling
from service.config import load_config

QUESTIONS = [
    "What is the capital of France?",
    # Longer answers: ~30 s each on 2 cores, so make check runs them, make test the first.
    pytest.param("写一个 Python 函数，计算斐波那契数列。", marks=pytest.mark.slow),
    pytest.param("List three fruits.", marks=pytest.mark.slow),
]


@pytest.fixture(scope="module")
def loaded(embedded_dir):
    """Float weights: the loop's own logic (cache, positions, chunks) against generate(),
    without int8 rounding, which turns the last-bit differences of two correct attention
    implementations into different answers now and then."""
    config = load_config(["--quantize", "none"], environ={})
    choice = ModelChoice(embedded_dir, EMBEDDED_NAME)
    return load_model(choice, config, lambda _: None)


@pytest.mark.parametrize("question", QUESTIONS)
def test_greedy_run_matches_generate(loaded, question):
    engine, prompts = loaded
    ids = prompts.encode([{"role": "user", "content": question}])
    pieces: list[str] = []
    result = engine.run(ids, Sampling(max_tokens=40), pieces.append, lambda: False)
    with torch.inference_mode():
        out = engine.model.generate(
            torch.tensor([ids]),
            max_new_tokens=40,
            do_sample=False,
            eos_token_id=sorted(engine.eos_ids),
        )
    expected = engine.tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True)
    assert "".join(pieces) == expected
    assert result.completion_tokens == len(out[0]) - len(ids)


def test_should_stop_is_obeyed_within_a_token(loaded):
    engine, prompts = loaded
    ids = prompts.encode([{"role": "user", "content": "Tell me a long story."}])
    calls = []

    def stop_after_three():
        calls.append(1)
        return len(calls) > 3

    result = engine.run(ids, Sampling(max_tokens=200), lambda _: None, stop_after_three)
    assert result.finish_reason == "interrupted" and result.completion_tokens <= 3


def test_a_long_prefill_notices_stop_between_chunks(loaded):
    engine, prompts = loaded
    ids = prompts.encode([{"role": "user", "content": "word " * 1500}])
    assert len(ids) > 3 * PREFILL_CHUNK
    calls = []

    def stop_during_prefill():
        calls.append(1)
        return len(calls) > 1  # the check before prefill passes, the first between chunks stops

    result = engine.run(ids, Sampling(max_tokens=5), lambda _: None, stop_during_prefill)
    assert result.finish_reason == "interrupted" and result.completion_tokens == 0
    assert len(calls) == 2
