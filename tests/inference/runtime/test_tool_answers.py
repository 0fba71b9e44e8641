"""Tool-call answers on the embedded model through the engine: the grammar of each tool
choice holds the answer to a valid call (or, with auto, text or calls), and the answer is
the same with and without speculation and beside another stream (the engine's guarantees
hold for the lark grammar as for a JSON schema)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from inference.runtime import tools
from inference.runtime.grammar import SchemaCompiler
from inference.runtime.jobs import Delta, Sampling
from inference.runtime.tools import CallArguments, CallEnd, CallStart, Function, ToolUse
from tests.support import schemas
from tests.support.engines import answer

pytestmark = pytest.mark.slow  # a model load and eight answers: about two minutes here

WEATHER, TIME = Function(**schemas.WEATHER), Function(**schemas.TIME)
FUNCTIONS = (WEATHER, TIME)
WEATHER_ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]
PLAIN_ASK = [{"role": "user", "content": "What is the capital of Japan?"}]


def calls_in(text: str) -> tuple[str, list[tuple[str, dict]]]:
    """The text outside calls and the whole calls, each checked against its schema."""
    wanted = {f.name: f.parameters for f in FUNCTIONS}
    outside, calls, names, arguments = "", [], {}, {}
    for piece in tools.read_all(text):
        if isinstance(piece, Delta):
            outside += piece.text
        elif isinstance(piece, CallStart):
            names[piece.index], arguments[piece.index] = piece.name, ""
        elif isinstance(piece, CallArguments):
            arguments[piece.index] += piece.text
        elif isinstance(piece, CallEnd):
            parsed = json.loads(arguments[piece.index])
            jsonschema.validate(parsed, wanted[names[piece.index]])
            calls.append((names[piece.index], parsed))
    assert len(calls) == len(names), "a call was cut short"
    return outside, calls


@pytest.fixture(scope="module")
def tool_grammar(engines):  # noqa: F811 - the fixture imported above
    engine, _, prompts = engines
    compiler = SchemaCompiler(lambda f: f(engine.tokenizer), engine.vocab_size)

    def make(use: ToolUse):
        return compiler.compile_lark(tools.grammar(use, prompts.tags_are_tokens), "tools")

    return make


@pytest.mark.parametrize("choice", ["required", "get_time"])
def test_a_required_call_is_valid_and_the_same_with_and_without_drafts(
    engines,  # noqa: F811
    tool_grammar,
    choice,
):
    engine, plain, prompts = engines
    # Parallel calls, the default: how many the model makes is its own choice (named
    # get_time: four in 127 tokens on the float32 cache, two in 63 on float16), so room.
    sampling = Sampling(max_tokens=256, grammar=tool_grammar(ToolUse(FUNCTIONS, choice)))
    ids = prompts.encode(WEATHER_ASK, tools=FUNCTIONS)
    fast, result = answer(engine, ids, sampling)
    assert fast == answer(plain, ids, sampling)[0]
    outside, calls = calls_in(fast)
    assert outside == "" and calls
    if choice != "required":
        assert {name for name, _ in calls} == {choice}
    assert result.finish_reason == "stop" and result.accepted > 0  # the call's fixed text


@pytest.mark.parametrize("ask", [PLAIN_ASK, WEATHER_ASK], ids=["plain", "weather"])
def test_auto_gives_text_or_valid_calls_the_same_with_and_without_drafts(
    engines,  # noqa: F811
    tool_grammar,
    ask,
):
    engine, plain, prompts = engines
    sampling = Sampling(max_tokens=64, grammar=tool_grammar(ToolUse(FUNCTIONS, "auto")))
    ids = prompts.encode(ask, tools=FUNCTIONS)
    fast, _ = answer(engine, ids, sampling)
    assert fast == answer(plain, ids, sampling)[0]
    outside, calls = calls_in(fast)
    assert outside.strip() or calls


def test_a_call_beside_another_stream_is_the_call_alone(engines, tool_grammar):  # noqa: F811
    engine, _, prompts = engines
    sampling = Sampling(max_tokens=96, grammar=tool_grammar(ToolUse(FUNCTIONS, "required")))
    ids = prompts.encode(WEATHER_ASK, tools=FUNCTIONS)
    alone = answer(engine, ids, sampling)[0]
    streams = [engine.open(ids, sampling), engine.open(prompts.encode(PLAIN_ASK), Sampling(48))]
    texts = ["", ""]
    while any(s.finish is None for s in streams):
        engine.step(streams)
        for i, stream in enumerate(streams):
            texts[i] += stream.take_text()
    for i, stream in enumerate(streams):
        engine.close(stream)
        texts[i] += stream.take_text()
    assert texts[0] == alone
