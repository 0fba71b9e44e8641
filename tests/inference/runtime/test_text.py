"""Incremental detokenization: whole characters only, stop strings never leak."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from inference.runtime.accept import TextAssembler

SAMPLE = "Hello, 世界! Café ☕ 🙂 naïve — done."


@pytest.fixture(scope="module")
def tokenizer(embedded_dir):
    return AutoTokenizer.from_pretrained(embedded_dir)


def feed(tokenizer, text: str, stop: tuple[str, ...] = ()) -> tuple[list[str], TextAssembler]:
    assembler = TextAssembler(tokenizer, stop)
    pieces = []
    for token in tokenizer.encode(text, add_special_tokens=False):
        pieces.append(assembler.add(token))
        if assembler.stopped:
            break
    pieces.append(assembler.flush())
    return [p for p in pieces if p], assembler


def test_pieces_add_up_to_the_text_with_no_broken_characters(tokenizer):
    pieces, _ = feed(tokenizer, SAMPLE)
    assert "".join(pieces) == SAMPLE
    assert not any("\ufffd" in p for p in pieces)
    assert len(pieces) > 5  # it really streamed


@pytest.mark.parametrize("stop", ["世界", "☕", "done", "naïve —"])
def test_stop_string_cuts_the_text_and_never_leaks(tokenizer, stop):
    pieces, assembler = feed(tokenizer, SAMPLE, (stop,))
    assert assembler.stopped
    assert "".join(pieces) == SAMPLE[: SAMPLE.index(stop)]


def test_a_stop_string_that_never_comes_holds_nothing_back_at_the_end(tokenizer):
    pieces, assembler = feed(tokenizer, SAMPLE, ("done!",))
    assert not assembler.stopped
    assert "".join(pieces) == SAMPLE


def test_long_mixed_text_streams_exactly(tokenizer):
    text = " ".join(f"第{i}行: naïve café {i} 🙂 — déjà vu." for i in range(60))
    pieces, _ = feed(tokenizer, text)
    assert "".join(pieces) == text


def test_token_pieces_spell_the_true_bytes(tokenizer):
    """Logprob entries: each token's bytes add up to the text, characters split across
    tokens included, and a token that holds a piece of a character says so."""
    from inference.runtime.accept import TokenPieces

    pieces = TokenPieces(tokenizer)
    ids = tokenizer.encode(SAMPLE, add_special_tokens=False)
    spelled = [pieces.piece(i) for i in ids]
    assert b"".join(bytes(raw) for _, raw in spelled) == SAMPLE.encode()
    partial = [(text, raw) for text, raw in spelled if text.startswith("bytes:")]
    assert partial, "the sample has characters split across tokens"
    for text, raw in spelled:
        if (text, raw) in partial:
            assert text == "bytes:" + "".join(f"\\x{b:02x}" for b in raw)  # as OpenAI writes
        else:
            assert bytes(raw).decode() == text
    assert pieces.piece(tokenizer.eos_token_id)[1] == ()  # left out of answers: no bytes
