"""Logprobs and penalties on the embedded model: a greedy answer's logprobs against a
separate forward of the same tokens, and the haiku loop that a penalty breaks. (Exactness
with and without drafts, alone and side by side: test_speculation.py.)"""

from __future__ import annotations

import pytest
import torch

from inference.model.decoder import Segment
from inference.runtime.jobs import Sampling
from tests.support.engines import encode

QUESTION = "What is the capital of France? Answer in one sentence."
HAIKU = "Write a haiku about autumn."
# Measured on the 2-core AVX2 build machine (embedded SmolLM2, int8-row), over the chosen
# tokens and the top-5 alternatives of a 7-token answer: against the same int8 model's
# forward of prompt + answer in one prefill, chosen tokens within 1e-5 but the last '.' 0.053
# and an alternative 0.49 nats (the prefill's attention sums in other blocks, and a per-row
# int8 activation scale turns that last-bit difference into a different rounding); the
# tolerances below are those measurements with room.
DECODE_VS_PREFILL = 0.75
INT8_VS_FLOAT = 1.5


def stepped(engine, prompt_ids, sampling) -> tuple[str, list[int], list]:
    """One stream, one token a step (a plain engine): text, answer ids (the end-of-text
    token included) and logprob entries."""
    stream = engine.open(prompt_ids, sampling)
    text, tokens, entries = "", [], []
    while stream.finish is None:
        engine.step([stream])
        assert stream.error is None and stream.completion_tokens == len(tokens) + 1
        tokens.append(stream.token)
        text += stream.take_text()
        entries += stream.take_logprobs()
    engine.close(stream)
    return text + stream.take_text(), tokens, entries + list(stream.take_logprobs())


@pytest.fixture(scope="module")
def greedy_answer(engines):
    _, plain, prompts = engines
    ids = encode(prompts, QUESTION)
    sampling = Sampling(max_tokens=32, logprobs=True, top_logprobs=5)
    text, tokens, entries = stepped(plain, ids, sampling)
    if tokens[-1] in plain.eos_ids:
        tokens = tokens[:-1]  # no entry: the end-of-text token is not part of the answer
    assert len(entries) == len(tokens) > 3
    return ids, text, tokens, entries


def test_entries_spell_the_answer_and_their_top_is_sorted(greedy_answer):
    _, text, _, entries = greedy_answer
    assert b"".join(bytes(e.bytes) for e in entries) == text.encode()
    for entry in entries:
        values = [t.logprob for t in entry.top]
        assert len(values) == 5 and values == sorted(values, reverse=True)
        assert entry.token in [t.token for t in entry.top]  # greedy: the best is picked
        assert entry.logprob == values[0]


def test_greedy_logprobs_are_the_log_softmax_of_a_separate_forward(engines, greedy_answer):
    engine, plain, _ = engines
    ids, _, tokens, entries = greedy_answer
    rows = prefill_rows(plain, ids + tokens)[len(ids) - 1 : len(ids) - 1 + len(tokens)]
    reference = torch.log_softmax(rows.double(), dim=-1)
    assert_close(plain, entries, tokens, reference, DECODE_VS_PREFILL)


def test_greedy_logprobs_are_the_float_models_within_int8s_error(
    engines, embedded_dir, greedy_answer
):
    from transformers import AutoModelForCausalLM

    _, plain, _ = engines
    ids, _, tokens, entries = greedy_answer
    model = AutoModelForCausalLM.from_pretrained(embedded_dir, dtype=torch.float32)
    with torch.inference_mode():
        logits = model(torch.tensor([ids + tokens])).logits[0]
    reference = torch.log_softmax(logits.double(), dim=-1)[len(ids) - 1 : -1]
    assert_close(plain, entries, tokens, reference, INT8_VS_FLOAT)


def prefill_rows(engine, ids: list[int]) -> torch.Tensor:
    cache = engine.decoder.new_cache(len(ids))
    return engine.decoder.forward([Segment(cache, ids)], every_row=True)


def assert_close(speller, entries, tokens, reference, tolerance) -> None:
    """Each entry's logprob is the reference's for its token, and its alternatives'
    values are the reference's five best (the order of near-ties may differ)."""
    worst = 0.0
    for entry, token, row in zip(entries, tokens, reference, strict=True):
        assert entry.token == speller.pieces.piece(token)[0]
        worst = max(worst, abs(entry.logprob - float(row[token])))
        best = row.topk(5).values.tolist()
        worst = max(worst, *(abs(t.logprob - b) for t, b in zip(entry.top, best, strict=True)))
    print(f"largest difference: {worst:.2e} nats")  # the measurement behind the tolerance
    assert worst <= tolerance


def test_a_sampled_request_reports_the_greedy_logprobs(engines):
    """Logprobs are taken before temperature and the cuts: the first token's distribution
    is the same whatever the request samples with."""
    _, plain, prompts = engines
    ids = encode(prompts, QUESTION)
    greedy = stepped(plain, ids, Sampling(max_tokens=1, logprobs=True, top_logprobs=3))[2]
    hot = Sampling(
        max_tokens=1, temperature=1.5, top_k=3, min_p=0.2, seed=1, logprobs=True, top_logprobs=3
    )
    sampled = stepped(plain, ids, hot)[2]
    assert greedy[0].top == sampled[0].top


def test_a_stop_string_cuts_the_text_inside_the_entries(engines, greedy_answer):
    _, plain, prompts = engines
    _, text, _, _ = greedy_answer
    stop = text.split()[3]
    sampling = Sampling(max_tokens=32, stop=(stop,), logprobs=True)
    cut, _, entries = stepped(plain, encode(prompts, QUESTION), sampling)
    assert cut == text[: text.index(stop)]
    spelled = b"".join(bytes(e.bytes) for e in entries).decode()
    assert spelled.startswith(cut) and stop in spelled  # up to the token that held the stop


# -- logit_bias --------------------------------------------------------------------------------


def test_a_bias_of_minus_100_on_the_best_token_picks_the_runner_up(engines, greedy_answer):
    """The bias comes before the pick and before logprobs: the first token is greedy's
    second choice, reported as the biased row's best, more likely than unbiased (the best's
    share has gone to the rest)."""
    _, plain, _ = engines
    ids, _, tokens, entries = greedy_answer
    runner_up = entries[0].top[1]
    bias = ((tokens[0], -100.0),)
    sampling = Sampling(max_tokens=1, logit_bias=bias, logprobs=True, top_logprobs=2)
    _, picked, biased = stepped(plain, ids, sampling)
    assert picked[0] != tokens[0]
    assert biased[0].token == biased[0].top[0].token == runner_up.token
    assert biased[0].logprob > runner_up.logprob


def test_a_bias_of_plus_100_keeps_every_pick_among_the_raised_tokens(engines):
    _, plain, prompts = engines
    raised = {prompts.encode_text(word)[0] for word in (" red", " green", " blue")}
    assert len(raised) == 3
    sampling = Sampling(max_tokens=12, logit_bias=tuple((t, 100.0) for t in sorted(raised)))
    text, tokens, _ = stepped(plain, encode(prompts, QUESTION), sampling)
    assert len(tokens) == 12 and set(tokens) <= raised  # never the end-of-text token
    assert set(text.split()) <= {"red", "green", "blue"}


# -- the haiku loop ---------------------------------------------------------------------------


def distinct_share(engine, prompts, sampling) -> tuple[float, str]:
    """Distinct answer tokens over answer tokens, and the answer."""
    text, tokens, _ = stepped(engine, encode(prompts, HAIKU), sampling)
    return len(set(tokens)) / len(tokens), text


@pytest.fixture(scope="module")
def looping(engines) -> float:
    """The issue's loop ("a leaf's path's path's ...") was Qwen's. The embedded model,
    greedy, copies its own phrase ("In the heart of the autumn, a tapestry of colors
    unfolds, a tapestry of colors.": 0.63 of its tokens distinct; before issue 33's
    conversion "a leaf's path is not just a leaf's path, ...", 0.52). Which phrase it copies
    is the model's choice at near-ties; that it repeats itself is what penalties act on."""
    _, plain, prompts = engines
    share, text = distinct_share(plain, prompts, Sampling(max_tokens=128))
    print(f"greedy: {share:.2f} {text!r}")
    assert share < 0.9, text
    return share


def test_a_penalty_breaks_the_greedy_haiku_loop(engines, looping):
    """frequency_penalty 2.0, the top of OpenAI's range: the repeated share falls by a
    margin. Measured (greedy 0.63 distinct): frequency 0.5 leaves the answer as it is, 1.0,
    1.5 and 2.0 give 0.84, 0.82 and 0.84; each setting of test_penalties_break_the_loop_
    not_by_luck, +0.20 at the median. (On the weights of before issue 33's conversion,
    greedy was 0.52 and frequency 2.0 0.80: +0.28.)"""
    _, plain, prompts = engines
    penalised, text = distinct_share(
        plain, prompts, Sampling(max_tokens=128, frequency_penalty=2.0)
    )
    print(f"frequency_penalty 2.0: {penalised:.2f} {text!r}")
    assert penalised > looping + 0.1, text


QWEN_DEFAULTS = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.1}
# Penalties that charge every repetition, each past where the greedy answer first changes,
# and Qwen's generation_config.json defaults under three seeds. Not presence: it charges a
# token once, and 1.0 and 1.5 made the answer longer and as repetitive in other words ("a
# moment of peace, a moment of light, a moment of stillness": 0.50 and 0.54 distinct
# against greedy's 0.63; 2.0: 0.78).
PENALISED = [
    *(Sampling(max_tokens=128, frequency_penalty=f) for f in (1.0, 1.5, 2.0)),
    *(Sampling(max_tokens=128, repetition_penalty=r) for r in (1.1, 1.2, 1.3)),
    *(Sampling(max_tokens=128, **QWEN_DEFAULTS, seed=seed) for seed in (1, 2, 3)),
]


@pytest.mark.slow
def test_penalties_break_the_loop_not_by_luck(engines, looping):
    """Not a coin flip: across nine settings the share of distinct tokens rises well above
    greedy's. Measured (greedy 0.63): frequency 1.0, 1.5, 2.0 +0.21, +0.19, +0.20;
    repetition 1.1, 1.2, 1.3 +0.19, +0.30, +0.37; Qwen's defaults under seeds 1-3 +0.00,
    +0.28, +0.15: median +0.20, so +0.1 is asked of the median. Any one setting may land
    on a near-tie (seed 1 found another answer as repetitive as greedy's)."""
    _, plain, prompts = engines
    gains = []
    for sampling in PENALISED:
        share, text = distinct_share(plain, prompts, sampling)
        print(f"{share:.2f} against greedy's {looping:.2f}: {text!r}")
        gains.append(share - looping)
    assert sorted(gains)[len(gains) // 2] >= 0.1, gains
