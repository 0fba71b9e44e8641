"""The tool-call grammar under llguidance with real tokenizers, no model: SmolLM2's (the tags
are text) and Qwen2.5's from the shared fixture (the tags are tokens of their own). Which
answers each tool choice lets through to the end, token by token as the engine feeds them."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoTokenizer

from inference.runtime import tools
from inference.runtime.grammar import SchemaCompiler
from inference.runtime.prompt import PromptBuilder
from inference.runtime.tools import Function, ToolUse, call_text
from service.errors import InvalidRequest
from tests.support import schemas
from tests.support.paths import qwen_fixture

WEATHER, TIME = Function(**schemas.WEATHER), Function(**schemas.TIME)
PARIS = call_text("get_weather", {"city": "Paris"})
NOON = call_text("get_time", {"zone": "UTC"})


class Model:
    """A tokenizer with its grammar compiler, and a check of whole answers."""

    def __init__(self, tokenizer, vocab_size: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.prompts = PromptBuilder(tokenizer, 4096)
        self.compiler = SchemaCompiler(lambda use: use(tokenizer), vocab_size)

    def grammar(self, use: ToolUse):
        lark = tools.grammar(use, self.prompts.tags_are_tokens)
        return self.compiler.compile_lark(lark, "tools")

    def allows(self, use: ToolUse, answer: str) -> bool:
        """Whether the grammar takes every token of `answer` and then lets it end."""
        ids = self.tokenizer.encode(answer, add_special_tokens=False)
        constraint = self.grammar(use).constraint()
        if constraint.valid_prefix(ids) != len(ids):
            return False
        for token in ids:
            constraint.take(token)
        logits = constraint.mask_(torch.zeros(self.vocab_size))
        return bool(logits[self.tokenizer.eos_token_id] == 0)


@pytest.fixture(scope="module", params=["smollm2", "qwen2.5"])
def model(request, embedded_dir):
    if request.param == "smollm2":
        return Model(AutoTokenizer.from_pretrained(embedded_dir), 49152)
    fixture = qwen_fixture()
    if not (fixture / "config.json").is_file():
        pytest.skip(f"no Qwen2.5 fixture at {fixture}")
    vocab = json.loads((fixture / "config.json").read_text())["vocab_size"]
    return Model(AutoTokenizer.from_pretrained(fixture), vocab)


def test_qwen_has_the_tags_as_tokens_and_smollm_does_not(model):
    has_tokens = "<tool_call>" in model.tokenizer.get_added_vocab()
    assert model.prompts.tags_are_tokens == has_tokens


REQUIRED = ToolUse((WEATHER, TIME), "required")


@pytest.mark.parametrize(
    "answer, allowed",
    [
        (PARIS, True),
        (NOON, True),
        (f"{PARIS}\n{NOON}", True),  # parallel calls, one newline apart
        ("Hello.", False),  # text is not a call
        (f"Sure.\n{PARIS}", False),
        (PARIS.replace('{"city": "Paris"}', '{"city":"Paris"}'), False),  # Qwen's layout only
        (PARIS.replace("city", "town"), False),  # the schema's property
        (call_text("get_news", {}), False),  # no such tool
        (PARIS[:-3], False),  # not finished
    ],
)
def test_required_allows_valid_calls_only(model, answer, allowed):
    assert model.allows(REQUIRED, answer) == allowed


def test_a_named_function_is_the_only_one(model):
    named = ToolUse((WEATHER, TIME), "get_time")
    assert model.allows(named, NOON)
    assert not model.allows(named, PARIS)


def test_without_parallel_calls_one_call_ends_the_answer(model):
    single = ToolUse((WEATHER, TIME), "required", parallel=False)
    assert model.allows(single, PARIS)
    assert not model.allows(single, f"{PARIS}\n{NOON}")


AUTO = ToolUse((WEATHER, TIME), "auto")


@pytest.mark.parametrize(
    "answer, allowed",
    [
        ("The capital of Japan is Tokyo.", True),
        ("", True),
        ("a <tool> tag, and <tool_call without its end", True),
        (PARIS, True),
        (f"{PARIS}\n{NOON}", True),
        (f"Let me check.\n{PARIS}", True),  # text, then calls
        (f"{PARIS}\nThanks.", False),  # nothing after the calls
        (PARIS.replace("city", "town"), False),  # a call it starts follows the schema
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": 5}}\n</tool_call>', False),
    ],
)
def test_auto_allows_text_or_valid_calls(model, answer, allowed):
    assert model.allows(AUTO, answer) == allowed


def test_a_bad_function_schema_is_refused_naming_tools(model):
    broken = Function("f", None, {"type": "object", "properties": {"x": {"type": "strnig"}}})
    with pytest.raises(InvalidRequest) as caught:
        model.grammar(ToolUse((broken,), "required"))
    assert caught.value.param == "tools"


def test_the_call_start_is_forced_for_a_named_function(model):
    """The engine drafts forced tokens (speculation): with one function, everything up to
    the arguments' first free choice is forced."""
    constraint = model.grammar(ToolUse((WEATHER,), "get_weather")).constraint()
    forced = model.tokenizer.decode(constraint.forced())
    assert forced.startswith('<tool_call>\n{"name": "get_weather", "arguments": {"')
