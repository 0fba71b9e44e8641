"""The grammar tokenizer built from token bytes (inference/runtime/grammar.py) is the one
llguidance builds from the HF tokenizer's JSON, to the byte: every token's bytes and special
mark, the text it tokenizes, the masks and forced tokens of JSON schemas and of the tool
grammar, token by token. SmolLM2's vocabulary (tags as text) and Qwen2.5's (tags as tokens,
ids past the vocabulary)."""

from __future__ import annotations

import json

import llguidance
import llguidance.hf
import pytest
from transformers import AutoTokenizer

from inference.runtime import tools
from inference.runtime.grammar import grammar_tokenizer
from inference.runtime.prompt import PromptBuilder
from inference.runtime.tools import Function, ToolUse, call_text
from tests.support import schemas
from tests.support.paths import qwen_fixture

TEXTS = [
    "Hello, world!",
    '{"city": "Paris", "n": 12}',
    "Ünïcödé ✓ 東京 🙂\n\t  spaces",
    "<tool_call>\n<|im_end|></tool_call>",
]
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}}},
    {"type": "array", "items": {"enum": ["alpha", "beta gamma", "Ünï"]}},
]


@pytest.fixture(scope="module", params=["smollm2", "qwen2.5"])
def pair(request, embedded_dir):
    """(HF tokenizer, vocab size, ours, llguidance's)."""
    if request.param == "smollm2":
        hf, vocab = AutoTokenizer.from_pretrained(embedded_dir), 49152
    else:
        fixture = qwen_fixture()
        if not (fixture / "config.json").is_file():
            pytest.skip(f"no Qwen2.5 fixture at {fixture}")
        hf = AutoTokenizer.from_pretrained(fixture)
        vocab = json.loads((fixture / "config.json").read_text())["vocab_size"]
    ref = llguidance.hf.from_tokenizer(hf, n_vocab=vocab)
    return hf, vocab, grammar_tokenizer(hf, vocab), ref


def test_it_is_built_from_the_bytes_not_from_the_json(pair):
    hf, _vocab, ours, ref = pair
    assert ours.is_canonical == ref.is_canonical
    assert ours.eos_tokens == ref.eos_tokens


def test_every_token_has_llguidances_bytes_and_special_mark(pair):
    _hf, vocab, ours, ref = pair
    assert ours.vocab_size == ref.vocab_size == vocab
    ids = list(range(vocab))
    assert [ours.decode_bytes([i]) for i in ids] == [ref.decode_bytes([i]) for i in ids]
    assert [ours.is_special_token(i) for i in ids] == [ref.is_special_token(i) for i in ids]
    assert ours.dbg_tokens(ids[-300:]) == ref.dbg_tokens(ids[-300:])


@pytest.mark.parametrize("text", TEXTS)
def test_text_tokenizes_the_same(pair, text):
    _hf, _vocab, ours, ref = pair
    for parse_special in (False, True):
        data = text.encode()
        assert ours.tokenize_bytes(data, parse_special=parse_special) == ref.tokenize_bytes(
            data, parse_special=parse_special
        )
    assert ours.tokenize_str(text) == ref.tokenize_str(text)


def _walk(tokenizers, grammar: str, answer_ids: list[int]) -> None:
    """Both matchers along `answer_ids`: the same mask and forced tokens at every token."""
    matchers = [llguidance.LLMatcher(t, grammar, log_level=0) for t in tokenizers]
    for token in answer_ids:
        masks = [m.compute_bitmask() for m in matchers]
        assert masks[0] == masks[1]
        assert matchers[0].compute_ff_tokens() == matchers[1].compute_ff_tokens()
        if not all(m.consume_token(token) for m in matchers):
            break
    assert matchers[0].is_accepting() == matchers[1].is_accepting()


@pytest.mark.parametrize("schema", SCHEMAS)
def test_json_schema_masks_are_the_same(pair, schema):
    hf, _vocab, ours, ref = pair
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        json.dumps(schema), defaults={"whitespace_flexible": False}
    )
    answer = '{"name": "Ünï", "n": 7}' if schema["type"] == "object" else '["alpha", "Ünï"]'
    _walk([ours, ref], grammar, hf.encode(answer, add_special_tokens=False))


def test_tool_grammar_masks_are_the_same(pair):
    hf, _vocab, ours, ref = pair
    tags_are_tokens = PromptBuilder(hf, 4096).tags_are_tokens
    use = ToolUse((Function(**schemas.WEATHER), Function(**schemas.TIME)), "auto")
    grammar = llguidance.LLMatcher.grammar_from_lark(tools.grammar(use, tags_are_tokens))
    answer = call_text("get_weather", {"city": "Paris"})
    _walk([ours, ref], grammar, hf.encode(answer, add_special_tokens=False))
