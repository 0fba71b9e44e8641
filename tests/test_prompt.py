"""Prompt building with the embedded model's real tokenizer and chat template."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from inference.errors import PayloadTooLarge
from inference.prompt import PromptBuilder


@pytest.fixture(scope="module")
def builder(embedded_dir):
    return PromptBuilder(AutoTokenizer.from_pretrained(embedded_dir), 64)


def text_of(builder, ids):
    return builder._tokenizer.decode(ids)


def test_default_system_prompt_comes_from_the_template(builder):
    text = text_of(builder, builder.encode([{"role": "user", "content": "hi"}]))
    assert "SmolLM" in text and text.rstrip().endswith("<|im_start|>assistant")


def test_system_replaces_the_default_and_any_given(builder):
    messages = [{"role": "system", "content": "old rule"}, {"role": "user", "content": "hi"}]
    text = text_of(builder, builder.encode(messages, system="You are Zorg."))
    assert "You are Zorg." in text
    assert "SmolLM" not in text and "old rule" not in text
    assert text.count("<|im_start|>system") == 1


def test_turns_keep_their_order(builder):
    messages = [
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "second"},
        {"role": "user", "content": "third"},
    ]
    text = text_of(builder, builder.encode(messages))
    assert text.index("first") < text.index("second") < text.index("third")


def test_check_fits_names_the_counts(builder):
    builder.check_fits(63)
    with pytest.raises(PayloadTooLarge, match="64 tokens.*at most 63"):
        builder.check_fits(64)
