"""The step's last part (inference/runtime/accept.py): tokens from rows of logits.

Real engine Streams and the embedded model's tokenizer, with logits written by hand (a
row's highest score is the token a greedy pick takes), so no forward runs. The
detokenizer's own rules: test_text.py."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from inference.model.decoder import Segment
from inference.runtime.accept import TextAssembler, TokenPieces, accept, advance, verify
from inference.runtime.engine import Stream
from inference.runtime.jobs import Sampling
from inference.runtime.schedule import Plan

EOS = 2


@pytest.fixture(scope="module")
def tokenizer(embedded_dir):
    return AutoTokenizer.from_pretrained(embedded_dir)


class Cache:
    """A KV cache's stand-in: its length, and where crop() cut it."""

    def __init__(self, length: int = 0):
        self.length = length

    def crop(self, length: int) -> None:
        self.length = length


def stream_of(tokenizer, sampling: Sampling, prompt=None, speculate=False) -> Stream:
    prompt = prompt or tokenizer.encode("Say hello.")
    text = TextAssembler(tokenizer, sampling.stop)
    stream = Stream(prompt, sampling, text, Cache(), speculate)
    stream.prefilled = len(prompt)
    return stream


def rows_picking(tokenizer, tokens: list[int]) -> torch.Tensor:
    """Logits whose greedy picks are `tokens`, one row each."""
    rows = torch.zeros(len(tokens), len(tokenizer))
    for row, token in enumerate(tokens):
        rows[row, token] = 10.0
    return rows


def words(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def test_a_pick_adds_its_text_and_the_budget_ends_the_answer(tokenizer):
    hello = words(tokenizer, "Hello there, friend")
    stream = stream_of(tokenizer, Sampling(max_tokens=len(hello)))
    pieces = TokenPieces(tokenizer)
    for scores in rows_picking(tokenizer, hello):
        assert advance(stream, scores, {EOS}, pieces) == stream.token
    assert stream.completion_tokens == len(hello) and stream.finish == "length"
    assert stream.take_text() + stream.text.flush() == "Hello there, friend"
    assert stream.ttft_s > 0


def test_the_logit_bias_comes_before_the_penalties(tokenizer):
    """Scores 1.0 (a prompt token) and 1.2, bias +1 on the first, repetition penalty 2:
    bias first gives (1 + 1) / 2 = 1.0 and the second token wins; penalty first would give
    1 / 2 + 1 = 1.5 and the first. llama.cpp and vLLM add the bias first too."""
    prompt = words(tokenizer, "Say hello.")
    seen, other = prompt[0], words(tokenizer, " friend")[0]
    sampling = Sampling(max_tokens=4, repetition_penalty=2.0, logit_bias=((seen, 1.0),))
    stream = stream_of(tokenizer, sampling, prompt)
    scores = torch.zeros(len(tokenizer))
    scores[seen], scores[other] = 1.0, 1.2
    assert advance(stream, scores, {EOS}, TokenPieces(tokenizer)) == other
    assert scores[seen] == 1.0  # the row as the pick saw it: biased, then penalised


def test_an_end_token_stops_without_text_and_a_stop_string_cuts_it(tokenizer):
    stream = stream_of(tokenizer, Sampling(max_tokens=10))
    advance(stream, rows_picking(tokenizer, [EOS])[0], {EOS}, TokenPieces(tokenizer))
    assert stream.finish == "stop" and stream.take_text() == ""
    stream = stream_of(tokenizer, Sampling(max_tokens=10, stop=(" there",)))
    for scores in rows_picking(tokenizer, words(tokenizer, "Hello there, friend")):
        advance(stream, scores, {EOS}, TokenPieces(tokenizer))
        if stream.finish:
            break
    assert stream.finish == "stop" and stream.take_text() == "Hello"


def test_logprobs_are_kept_for_answer_tokens(tokenizer):
    stream = stream_of(tokenizer, Sampling(max_tokens=4, logprobs=True, top_logprobs=2))
    hello = words(tokenizer, "Hello")
    for scores in rows_picking(tokenizer, [*hello, EOS]):
        advance(stream, scores, {EOS}, TokenPieces(tokenizer))
    entries = stream.take_logprobs()
    assert [e.token for e in entries] == ["Hello"]  # none for the end token
    assert len(entries[0].top) == 2 and entries[0].top[0].token == "Hello"


def test_a_draft_is_taken_up_to_the_first_pick_that_differs(tokenizer):
    """Rows of [token, d1, d2, d3]: picks agree with d1 and d2, not d3; the picks are the
    answer and the cache is cut back past the row that read the wrong draft."""
    a, b, c, d, x = words(tokenizer, " one two three four five")
    prompt = tokenizer.encode("Count: one two three four")
    stream = stream_of(tokenizer, Sampling(max_tokens=20), prompt=prompt, speculate=True)
    stream.cache.length = len(prompt) + 4  # the forward wrote the four rows
    verify(stream, rows_picking(tokenizer, [a, b, c, d]), [a, b, x], {EOS}, TokenPieces(tokenizer))
    assert stream.completion_tokens == 3 and stream.token == c
    assert (stream.drafted, stream.accepted, stream.steps) == (3, 2, 1)
    assert stream.cache.length == len(prompt) + 3  # the row after the missed draft is gone
    assert stream.take_text() == " one two three"


def test_accept_walks_the_plan_and_a_failing_stream_ends_alone(tokenizer):
    pieces = TokenPieces(tokenizer)
    reading = stream_of(tokenizer, Sampling(max_tokens=5), prompt=list(range(10, 50)))
    reading.prefilled = 0
    ending = stream_of(tokenizer, Sampling(max_tokens=5), prompt=list(range(10, 26)))
    ending.prefilled = 0
    broken = stream_of(tokenizer, Sampling(max_tokens=5))
    broken.sampling = None  # its pick raises: its own fault
    decoding = stream_of(tokenizer, Sampling(max_tokens=5), speculate=True)
    plan = Plan()
    plan.add(reading, Segment(reading.cache, reading.prompt_ids[:32]))
    plan.add(ending, Segment(ending.cache, ending.prompt_ids))
    plan.add(broken, Segment(broken.cache, [1], decoding=True))
    plan.add(decoding, Segment(decoding.cache, [1, 7], decoding=True))
    hi = words(tokenizer, "Hi")[0]
    # a prompt chunk gives one row (its last), a decode segment one per id, in plan order
    picks = [0, hi, 0, hi, hi]
    assert accept(plan, rows_picking(tokenizer, picks), {EOS}, pieces) == (1, 0)
    assert reading.prefilled == 32 and reading.completion_tokens == 0  # more prompt to read
    assert ending.prefilled == 16 and ending.token == hi  # its first token, from its last row
    assert broken.finish == "error" and broken.error is not None
    assert decoding.token == hi and decoding.completion_tokens == 1  # draft 7 not taken
