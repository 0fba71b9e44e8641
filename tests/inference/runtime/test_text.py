"""Incremental detokenization: whole characters only, stop strings never leak."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from inference.runtime.detokenize import TextAssembler

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
