"""The step's first part (inference/runtime/schedule.py): which rows run, on token lists.

Real engine Streams without a model: the cache is a stand-in the scheduler only hands on,
and no text is made. The drafter's own rules: test_speculation.py."""

from __future__ import annotations

import pytest

from inference.runtime.engine import Stream
from inference.runtime.jobs import Sampling
from inference.runtime.schedule import (
    MOST_BESIDE,
    PREFILL_BESIDE,
    SHORT_REST,
    SLOWER,
    PromptChunks,
    draft,
    schedule,
)

ALONE, BLOCK = 256, 16


class Cache:
    """A KV cache's stand-in: empty, as a new stream's is."""

    length = 0


def decoding(token: int, prompt: list[int] | None = None, speculate=False, budget=64) -> Stream:
    """A stream past its prompt whose next input is `token`."""
    prompt = prompt or [1, 2, 3]
    stream = Stream(prompt, Sampling(budget), None, Cache(), speculate)
    stream.prefilled, stream.token, stream.completion_tokens = len(prompt), token, 1
    return stream


def prefilling(length: int, read: int = 0) -> Stream:
    """A stream with `read` of its `length` prompt tokens in the cache."""
    stream = Stream(list(range(100, 100 + length)), Sampling(8), None, Cache(), False)
    stream.prefilled = read
    return stream


class Constraint:
    """A grammar's stand-in: the tokens it forces, and how much of a guess it allows."""

    def __init__(self, forced=(), valid=0, error=None):
        self._forced, self._valid, self._error = list(forced), valid, error

    def forced(self) -> list[int]:
        if self._error is not None:
            raise self._error
        return self._forced

    def valid_prefix(self, tokens: list[int]) -> int:
        return min(self._valid, len(tokens))


def test_decoding_rows_first_then_prompt_chunks_beside_them():
    first, second = decoding(7), decoding(8)
    long = prefilling(300)
    plan = schedule([long, first, second], ALONE, BLOCK)
    assert plan.streams == [first, second, long]
    assert [s.ids for s in plan.segments] == [[7], [8], long.prompt_ids[:PREFILL_BESIDE]]
    assert [s.decoding for s in plan.segments] == [True, True, False]
    assert plan.segments[0].cache is first.cache  # each row runs over its own stream's cache


def test_beside_answers_one_short_prompt_a_step_comes_whole():
    answering = decoding(7)
    short, other = prefilling(SHORT_REST), prefilling(40)
    plan = schedule([answering, short, other], ALONE, 1, beside_rows=3)
    # the first short prompt in one step, the next one in the measured chunk
    assert [len(s.ids) for s in plan.segments] == [1, SHORT_REST]
    plan = schedule([answering, other], ALONE, 1, beside_rows=3)
    assert [len(s.ids) for s in plan.segments] == [1, 40]
    # a long prompt goes in measured chunks to its end
    long = prefilling(300, read=300 - SHORT_REST)
    assert len(schedule([answering, long], ALONE, 1, beside_rows=3).segments[1].ids) == 3
    # what the prefix cache gave does not count: a new prompt with few rows left comes whole
    cached = prefilling(300)
    cached.prefilled = cached.reused = 300 - 20
    assert len(schedule([answering, cached], ALONE, 1, beside_rows=3).segments[1].ids) == 20


def test_alone_a_prompt_gets_the_big_chunk_and_whole_blocks_are_counted():
    short, long, late = prefilling(5), prefilling(600), prefilling(40)
    plan = schedule([short, long, late], ALONE, BLOCK)
    # 5 rows take a whole block of the room: the long one gets 256 - 16, the last none
    assert [len(s.ids) for s in plan.segments] == [5, ALONE - BLOCK]
    assert plan.streams == [short, long]
    resumed = prefilling(600, read=ALONE - BLOCK)
    assert schedule([resumed], ALONE, BLOCK).segments[0].ids == resumed.prompt_ids[240:496]


def test_finished_streams_and_an_empty_batch_schedule_nothing():
    done = decoding(7)
    done.finish = "stop"
    assert schedule([done], ALONE, BLOCK).segments == []
    assert schedule([], ALONE, BLOCK).streams == []


def test_a_draft_runs_after_the_token_within_the_budget():
    stream = decoding(3, prompt=[1, 2, 3, 4, 5, 6, 1, 2], speculate=True, budget=3)
    stream.lookup.extend([3])  # the answer so far ends with 2, 3: 4, 5, 6 followed it
    stream.lookup.limit = 4  # a stream that has copied well (its first draft is 1 token)
    assert draft(stream) == [4, 5]  # the room left: a budget of 3, one token made
    plan = schedule([stream], ALONE, BLOCK)
    assert plan.segments[0].ids == [3, 4, 5] and plan.segments[0].decoding
    assert draft(decoding(3, prompt=[1, 2, 3, 4, 1, 2], speculate=False)) == []
    spent = decoding(3, prompt=[1, 2, 3, 4, 1, 2], speculate=True, budget=1)
    assert draft(spent) == []  # no room: its next token is its last


def test_under_a_grammar_forced_tokens_first_else_the_guess_it_allows():
    stream = decoding(3, prompt=[1, 2, 3, 4, 5, 6, 1, 2], speculate=True)
    stream.lookup.extend([3])
    stream.constraint = Constraint(forced=[40, 41])
    assert draft(stream) == [40, 41]  # jump-forward: what the grammar forces
    stream.constraint = Constraint(valid=1)
    assert draft(stream) == [4]  # the lookup's guess, cut where the grammar refuses it


def test_a_draft_that_raises_ends_that_stream_alone():
    broken = decoding(3, prompt=[1, 2, 3, 1, 2], speculate=True)
    broken.constraint = Constraint(error=RuntimeError("grammar"))
    other = decoding(9)
    plan = schedule([broken, other], ALONE, BLOCK)
    assert plan.streams == [other]
    assert broken.finish == "error" and isinstance(broken.error, RuntimeError)
    with pytest.raises(RuntimeError):
        draft(broken)


# -- how many prompt rows ride beside answering streams (PromptChunks), from step times
# given to it: the chunk keeps a step within about SLOWER times a step without


def test_the_fixed_chunk_until_both_costs_are_measured():
    chunks = PromptChunks(align=1)
    assert chunks.beside() == PREFILL_BESIDE
    chunks.observe(3, 0, 0.030)  # a decode step of three streams
    assert chunks.beside() == PREFILL_BESIDE
    chunks.observe(0, 256, 256 * 0.004)  # a prompt alone: 4 ms a row
    assert chunks.beside() == int((SLOWER - 1) * 0.030 / 0.004)  # 7 rows: 30 + 28 ms


def test_a_step_beside_answers_teaches_the_prompt_rows_cost():
    chunks = PromptChunks(align=1)
    chunks.observe(3, 0, 1 / 32)
    for _ in range(40):  # steps of 3 answer rows and 4 prompt rows, 3 / 32 s each
        chunks.observe(3, 4, 3 / 32)
    assert chunks.beside() == 2  # 1/64 s a prompt row: 2 rows double the step
    assert chunks.decode_s == 1 / 32  # steps with prompt rows leave the decode cost alone


def test_a_busy_pc_slows_both_and_the_chunk_stays():
    quiet, busy = PromptChunks(align=1), PromptChunks(align=1)
    for chunks, slow in ((quiet, 1.0), (busy, 1.8)):
        chunks.observe(3, 0, 0.030 * slow)
        chunks.observe(0, 256, 256 * 0.004 * slow)
    assert quiet.beside() == busy.beside()


def test_whole_blocks_off_the_native_step_and_bounds():
    chunks = PromptChunks(align=16)
    chunks.observe(3, 0, 0.030)
    chunks.observe(0, 256, 256 * 0.004)
    assert chunks.beside() == 16  # at least one block, even where 7 rows would do
    chunks.observe(3, 0, 10.0)  # a very slow decode step: the chunk grows, up to MOST_BESIDE
    assert chunks.beside() == MOST_BESIDE
    cheap = PromptChunks(align=1)
    cheap.observe(3, 0, 0.030)
    cheap.observe(0, 256, 0.0)  # rows that cost nothing measurable
    assert cheap.beside() == PREFILL_BESIDE
