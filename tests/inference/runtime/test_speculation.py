"""Prompt-lookup speculation: the same answers in fewer steps, whatever runs beside them.

The drafter's rules are checked on token lists; exactness on the embedded model, with two
engines on one loaded model, one speculating and one not."""

from __future__ import annotations

import dataclasses
import json
import time

import pytest

from inference.runtime import schedule as speculation  # the drafter lives in the scheduler
from inference.runtime.jobs import Done, Failed, Job, Sampling
from inference.runtime.schedule import PromptLookup
from service.errors import Cancelled, Timeout
from tests.support.engines import answer, encode, side_by_side
from tests.support.fakes import terminal_events
from tests.support.schemas import TICKET

# -- the drafter -----------------------------------------------------------------------------


def test_a_draft_is_what_followed_the_longest_recent_match():
    lookup = PromptLookup([1, 2, 3, 4, 5, 9, 2, 3, 7, 8])
    lookup.extend([0, 2, 3])  # the answer so far ends with 2, 3: last seen before 7, 8
    lookup.limit = 4  # a stream that has copied well (how the length moves: below)
    assert lookup.draft(8) == [7, 8, 0, 2, 3][: lookup.limit]
    lookup.extend([4])  # ends with 2, 3, 4 now: only the prompt's start has it
    assert lookup.draft(8) == [5, 9, 2, 3][: lookup.limit]
    assert lookup.draft(2) == [5, 9]  # never more than the room left


def test_nothing_is_drafted_without_a_match_of_two_tokens():
    lookup = PromptLookup([10, 11, 12, 13])
    lookup.extend([12, 99])  # 99 was never seen; one token (12) alone is no match
    assert lookup.draft(8) == []
    assert PromptLookup([]).draft(8) == []


def test_the_draft_length_follows_what_the_stream_accepts():
    lookup = PromptLookup(list(range(40)) * 2)
    assert lookup.limit == speculation.FIRST == 1  # a first miss costs one row, not four
    for taken, then in ((1, 2), (2, 4), (4, 8)):
        lookup.verified(taken, taken)
        assert lookup.limit == then  # twice as many after a draft taken whole
    lookup.verified(8, 8)
    assert lookup.limit == speculation.MOST  # never past it
    lookup.verified(8, 2)
    assert lookup.limit == 3  # one more than it took
    lookup.verified(0, 0)  # nothing drafted: nothing learnt
    assert lookup.limit == 3


def test_misses_in_a_row_pause_drafting_for_longer_each_time():
    lookup = PromptLookup([1, 2, 3, 1, 2])  # ends with 1, 2: a match that will miss
    paused = []
    for _ in range(5):
        assert lookup.draft(8)
        lookup.verified(1, 0)
        skipped = 0
        while not lookup.draft(8):
            skipped += 1
        paused.append(skipped)
    assert paused == [1, 2, 4, 8, 16]
    lookup.verified(1, 1)  # a hit resets the pause
    lookup.verified(2, 0)
    skipped = 0
    while not lookup.draft(8):
        skipped += 1
    assert skipped == 1


# -- exactness on the embedded model ---------------------------------------------------------

TICKET_TEXT = (
    "Ticket 4471 from Maria Keller (Accounting, room 214): since the update on Monday the "
    "printer HP-3 on the second floor prints every invoice twice, and the second copy has "
    "no page numbers. Restarting the printer did not help. She needs it fixed before the "
    "month-end close on Friday."
)
CODE = (
    "def average(values):\n    total = 0\n    for x in values:\n        total = total + x\n"
    "    return total / len(values)\n"
)
GROUNDED = [
    f"Summarize this ticket in two sentences:\n\n{TICKET_TEXT}",
    f"Fix the spelling, keep everything else: {TICKET_TEXT.replace('the', 'teh')}",
    f"Rename the variable x to value in this function and return the code:\n\n{CODE}",
    f"Extract the name, department and problem from this ticket as JSON:\n\n{TICKET_TEXT}",
]
OPEN = "Write a haiku about autumn."
GREEDY = Sampling(max_tokens=96)


def test_greedy_answers_are_the_same_with_and_without_drafts(engines):
    engine, plain, prompts = engines
    drafted = accepted = 0
    for question in [*GROUNDED, OPEN]:
        ids = encode(prompts, question)
        fast, result = answer(engine, ids, GREEDY)
        slow, base = answer(plain, ids, GREEDY)
        assert fast == slow, question
        assert result.completion_tokens == base.completion_tokens
        assert base.drafted == 0 and base.steps == base.completion_tokens
        assert result.steps == result.completion_tokens - result.accepted
        drafted, accepted = drafted + result.drafted, accepted + result.accepted
    # the grounded answers copy: drafts were taken, in fewer steps than tokens
    assert accepted > 0 and drafted >= accepted


@pytest.mark.slow
def test_every_answer_of_the_bench_task_set_is_the_same_with_drafts(engines):
    """The 32 prompts python -m bench --speculation measures, 160 tokens as it asks."""
    from bench.speculation_tasks import TASKS

    engine, plain, prompts = engines
    sampling = Sampling(max_tokens=160)
    accepted = 0
    for task in TASKS:
        ids = prompts.encode(task.messages)
        fast, result = answer(engine, ids, sampling)
        assert fast == answer(plain, ids, sampling)[0], task.name
        accepted += result.accepted
    assert accepted > 0


@pytest.mark.slow
def test_answers_are_the_same_with_drafts_beside_other_streams(engines):
    engine, plain, prompts = engines
    jobs = [encode(prompts, q) for q in [*GROUNDED, OPEN]]
    expected = [answer(plain, ids, GREEDY)[0] for ids in jobs]
    together = side_by_side(engine, [(ids, GREEDY) for ids in jobs])
    assert [text for text, _ in together] == expected


# Penalties depend on every token before: what a drafted row sees must be what a step of its
# own saw. Greedy and seeded-sampled, with logprobs (they are compared too).
PENALISED = [
    Sampling(
        max_tokens=64,
        repetition_penalty=1.2,
        frequency_penalty=0.4,
        presence_penalty=0.2,
        logprobs=True,
        top_logprobs=3,
    ),
    Sampling(
        max_tokens=64,
        temperature=0.7,
        top_p=0.8,
        top_k=20,
        min_p=0.05,
        repetition_penalty=1.1,
        seed=5,
        logprobs=True,
        top_logprobs=2,
    ),
    # The two above penalise every prompt token, so copying from the prompt (what drafts
    # are) rarely wins: on the native step they take no draft on these questions. Penalties
    # on answer tokens alone leave copying free: drafts are taken, and verified rows must
    # see the counts a step of their own would (measured: 7 and 5 drafted tokens taken).
    Sampling(max_tokens=64, frequency_penalty=0.4, presence_penalty=0.2, logprobs=True),
]


def test_penalised_answers_and_logprobs_are_the_same_with_and_without_drafts(engines):
    engine, plain, prompts = engines
    accepted = 0
    for sampling in PENALISED:
        for question in [GROUNDED[0], GROUNDED[2], OPEN]:
            ids = encode(prompts, question)
            before = engine.accepted_tokens
            [fast] = side_by_side(engine, [(ids, sampling)])
            accepted += engine.accepted_tokens - before
            [slow] = side_by_side(plain, [(ids, sampling)])
            assert fast == slow, (question, sampling)
            assert len(fast[1]) > 8  # an answer, with an entry per token
    assert accepted > 0  # drafts were taken under penalties: the test saw verified rows


def test_penalised_answers_are_the_same_alone_and_side_by_side(engines):
    engine, plain, prompts = engines
    jobs = [
        (encode(prompts, question), sampling)
        for question, sampling in zip(
            [GROUNDED[0], GROUNDED[2], OPEN, GROUNDED[1]], [*PENALISED, PENALISED[0]], strict=True
        )
    ]
    alone = [side_by_side(plain, [job])[0] for job in jobs]
    assert side_by_side(engine, jobs) == alone


def test_a_biased_answer_is_the_same_with_drafts_alone_and_side_by_side(engines):
    """logit_bias moves every pick, a drafted row's too: verifying a draft must see it.
    The bias bans (-100) words each greedy answer has (all three begin "The") and raises
    (+3) one of the prompts' words."""
    engine, plain, prompts = engines
    banned = {prompts.encode_text(word)[0] for word in ("The", " the", " a")}
    raised = prompts.encode_text(" printer")[0]
    bias = tuple(sorted([*((t, -100.0) for t in banned), (raised, 3.0)]))
    jobs = [(encode(prompts, q), Sampling(max_tokens=64, logit_bias=bias)) for q in GROUNDED[:3]]
    before = engine.accepted_tokens
    alone = [side_by_side(plain, [job])[0] for job in jobs]
    assert [side_by_side(engine, [job])[0] for job in jobs] == alone
    assert engine.accepted_tokens > before  # drafts were taken: the test saw verified rows
    assert side_by_side(engine, jobs) == alone
    unbiased = [side_by_side(plain, [(ids, Sampling(max_tokens=64))])[0] for ids, _ in jobs]
    assert all(a != b for a, b in zip(alone, unbiased, strict=True))  # each answer moved


def test_seeded_sampling_gives_the_same_text_with_and_without_drafts(engines):
    engine, plain, prompts = engines
    ids = encode(prompts, GROUNDED[1])
    sampled = Sampling(max_tokens=64, temperature=0.7, top_p=0.9, seed=11)
    fast, result = answer(engine, ids, sampled)
    assert fast == answer(plain, ids, sampled)[0]
    assert fast == answer(engine, ids, sampled)[0]  # and the same again
    other = dataclasses.replace(sampled, seed=12)
    assert answer(plain, ids, other)[0] == answer(engine, ids, other)[0]


def test_a_json_schema_answer_stays_valid_and_drafts_what_the_grammar_forces(engines):
    from inference.runtime.grammar import SchemaCompiler

    engine, plain, prompts = engines
    compiler = SchemaCompiler(lambda f: f(engine.tokenizer), engine.vocab_size)
    grammar = compiler.compile(TICKET, "response_format")
    sampling = Sampling(max_tokens=300, grammar=grammar)
    ids = encode(prompts, f"Write the ticket for this as JSON:\n\n{TICKET_TEXT}")
    fast, result = answer(engine, ids, sampling)
    assert fast == answer(plain, ids, sampling)[0]
    json.loads(fast)  # complete and valid
    assert result.accepted > 0  # the key names and quotes came as drafts


def test_after_a_rejected_draft_the_cache_gives_the_next_token_a_fresh_prefill_gives(engines):
    """Run with drafts until one was refused, then compare the stream's cache with a plain
    stream's at the same point (bitwise) and with a fresh prefill of the same tokens."""
    from inference.model.decoder import Segment

    engine, plain, prompts = engines
    for question in [*GROUNDED, OPEN]:  # the first answer with a refused draft
        ids = encode(prompts, question)
        fast = engine.open(ids, GREEDY)
        while fast.finish is None and fast.drafted == fast.accepted:
            engine.step([fast])
        if fast.finish is None:
            break
        engine.close(fast)
    assert fast.finish is None and fast.drafted > fast.accepted  # a rollback happened
    slow = plain.open(ids, GREEDY)
    while slow.completion_tokens < fast.completion_tokens:
        plain.step([slow])
    assert (slow.token, slow.cache.length) == (fast.token, fast.cache.length)
    answered = fast.cache.length - len(ids)  # answer tokens whose keys the cache holds
    fresh = engine.decoder.new_cache(fast.cache.length + 1)
    history = fast.lookup.history[: len(ids) + answered]
    engine.decoder.forward([Segment(fresh, history)])
    rows = [
        engine.decoder.forward([Segment(cache, [fast.token], decoding=True)])[0]
        for cache in (fast.cache, slow.cache, fresh)
    ]
    assert bool((rows[0] == rows[1]).all())
    # a prefill's attention sums in other blocks (inference/model/attention.py): not the
    # same bits, the same choice
    assert int(rows[0].argmax()) == int(rows[2].argmax())
    engine.close(fast, interrupted=True)
    plain.close(slow, interrupted=True)


COPY = "Repeat this text exactly, word for word:\n\n" + " ".join([TICKET_TEXT] * 3)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["cancel", "deadline"])
def test_cancel_and_deadline_in_the_middle_of_drafted_steps(engines, worker_for, how):
    engine, plain, prompts = engines
    ids = encode(prompts, COPY)
    before = engine.accepted_tokens
    worker = worker_for(engine)
    job = worker.submit(Job(ids, Sampling(max_tokens=400), 60))
    first = job.events.get(timeout=30)
    assert first.text
    while engine.accepted_tokens == before:  # stop it while drafts are being taken
        job.events.get(timeout=30)
    if how == "cancel":
        job.cancel()
    else:  # its deadline passes now (a fixed one raced the answer: the native step ends it)
        job.timeout_s = time.monotonic() - job.created
    deltas, ended = terminal_events(job)
    assert isinstance(ended, Failed)
    assert isinstance(ended.error, Cancelled if how == "cancel" else Timeout)
    assert engine.accepted_tokens > before
    # the engine is clean for the next job: the same answer as the plain engine's
    nxt = worker.submit(Job(encode(prompts, GROUNDED[2]), GREEDY, 60))
    deltas, done = terminal_events(nxt)
    assert isinstance(done, Done)
    assert "".join(deltas) == answer(plain, encode(prompts, GROUNDED[2]), GREEDY)[0]
