"""Prompt building with the embedded model's real tokenizer and chat template."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from inference.runtime.prompt import PromptBuilder
from service.errors import PayloadTooLarge


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


def test_handlers_and_the_worker_can_share_one_tokenizer(embedded_dir):
    """The loader gives handlers and the worker one tokenizer (issue 10: ~100 MB less):
    handlers encode under the builder's lock while the worker decodes beside them."""
    import threading

    from inference.runtime.prompt import read_only

    tokenizer = AutoTokenizer.from_pretrained(embedded_dir)
    tokenizer.backend_tokenizer.enable_truncation(8)  # as a tokenizer.json may set it
    read_only(tokenizer)
    assert tokenizer.backend_tokenizer.truncation is None
    shared = PromptBuilder(tokenizer, 4096)
    questions = [f"Question {i}: what is {i} times {i + 3}? 你好, résumé" for i in range(12)]
    reference = PromptBuilder(AutoTokenizer.from_pretrained(embedded_dir), 4096)
    want = {q: reference.encode([{"role": "user", "content": q}]) for q in questions}
    assert all(len(ids) > 8 for ids in want.values())  # nothing truncated
    texts = {q: tokenizer.decode(ids, skip_special_tokens=True) for q, ids in want.items()}
    failures = []

    def handler():
        for q in questions * 30:
            if shared.encode([{"role": "user", "content": q}]) != want[q]:
                failures.append(f"encode {q!r}")

    def worker():
        for q in questions * 60:
            if tokenizer.decode(want[q], skip_special_tokens=True) != texts[q]:
                failures.append(f"decode {q!r}")

    def recording(work):
        def run():
            try:
                work()
            except Exception as exc:  # "Already borrowed" and the like
                failures.append(repr(exc))

        return threading.Thread(target=run)

    threads = [recording(handler) for _ in range(3)] + [recording(worker)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    assert failures == []


def test_a_tokenizer_without_its_build_copies_encodes_and_decodes_the_same(embedded_dir):
    from inference.runtime.prompt import shed_build_copies

    fresh, shed = (AutoTokenizer.from_pretrained(embedded_dir) for _ in range(2))
    shed_build_copies(shed)
    assert not hasattr(shed, "_vocab") and not hasattr(shed, "_merges")
    messages = [{"role": "user", "content": "Résumé of 你好, in Python: print('hi')"}]
    ids = PromptBuilder(fresh, 4096).encode(messages)
    assert PromptBuilder(shed, 4096).encode(messages) == ids
    assert shed.decode(ids, skip_special_tokens=True) == fresh.decode(ids, skip_special_tokens=True)
    assert shed.get_vocab() == fresh.get_vocab()


@pytest.mark.slow
def test_the_loader_hands_handlers_and_worker_one_settled_tokenizer(embedded_dir):
    import dataclasses

    from inference.loading.assemble import ModelChoice, load_model
    from service.config import load_config

    config = dataclasses.replace(load_config([], {}), quantize="int8-row")
    engine, prompts = load_model(ModelChoice(embedded_dir, "embedded"), config, lambda _m: None)
    tokenizer = engine.tokenizer
    assert prompts.with_tokenizer(lambda t: t) is tokenizer
    assert tokenizer.backend_tokenizer.truncation is None
    assert tokenizer.backend_tokenizer.padding is None
    assert not hasattr(tokenizer, "_vocab") and not hasattr(tokenizer, "_merges")


def test_a_raw_prompt_reads_control_names_as_tokens(builder):
    messages = [{"role": "user", "content": "hi <|im_end|> there"}]
    rendered = builder._tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert builder.encode_raw(rendered) == builder.encode([{"role": "user", "content": "hi"}])
    end = builder._tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert builder.encode_raw("hi <|im_end|>").count(end) == 1
    assert builder.encode(messages).count(end) == 2  # in a message: characters, not a turn's end
