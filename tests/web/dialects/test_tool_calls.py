"""Issue 27's test of done: the official `openai` client, changed only in base_url and
api_key, runs a two-round agent loop against the embedded model (SmolLM2-135M, greedy):
two tools and tool_choice "required" give a valid call, its result goes back as a `tool`
message, and the model answers in text; the same loop streamed, accumulated by the
client's own stream helper, gives the same call and answer. /chat gives the same call in
its own shape."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.support import schemas
from tests.support.httpclient import chat

WEATHER = {"type": "function", "function": schemas.WEATHER}
TIME = {"type": "function", "function": schemas.TIME}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]
RESULT = '{"city": "Paris", "weather": "sunny", "temperature_c": 21}'
# One forced call (parallel_tool_calls false) and room for the longest one the schemas allow:
# a 40-character city, each character up to 4 byte tokens, and the call's tags and JSON.
# Then a call is owed at any near-tie, whichever tool and city the model picks; with
# parallel calls, how many it makes is its own choice and may run past any budget.
ONE_CALL = {"tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 256}


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")


def check_call(call) -> None:
    assert call.id.startswith("call_") and call.type == "function"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def calls_of(completion) -> list[tuple[str, str]]:
    calls = completion.choices[0].message.tool_calls
    return [(c.function.name, c.function.arguments) for c in calls]


def second_round(call) -> list[dict]:
    """The conversation with the call and its result, as an agent loop sends it back."""
    assistant = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.function.name, "arguments": call.function.arguments},
            }
        ],
    }
    return [*ASK, assistant, {"role": "tool", "tool_call_id": call.id, "content": RESULT}]


def test_a_two_round_agent_loop_whole_and_streamed(embedded_server):
    api = client(embedded_server)
    first = api.chat.completions.create(model="deskchat", messages=ASK, tools=TOOLS, **ONE_CALL)
    [choice] = first.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    check_call(call)
    answer = api.chat.completions.create(
        model="deskchat", messages=second_round(call), tools=TOOLS, max_tokens=48
    )
    text = answer.choices[0].message.content
    assert text and not answer.choices[0].message.tool_calls, answer

    with api.chat.completions.stream(
        model="deskchat", messages=ASK, tools=TOOLS, **ONE_CALL
    ) as stream:
        streamed_first = stream.get_final_completion()
    [streamed_call] = streamed_first.choices[0].message.tool_calls
    check_call(streamed_call)
    assert streamed_first.choices[0].finish_reason == "tool_calls"
    assert calls_of(streamed_first) == calls_of(first)
    with api.chat.completions.stream(
        model="deskchat", messages=second_round(streamed_call), tools=TOOLS, max_tokens=48
    ) as stream:
        streamed_answer = stream.get_final_completion()
    assert streamed_answer.choices[0].message.content == text


def test_the_assistant_message_goes_back_as_the_client_returned_it(embedded_server):
    """An agent loop appends the message object itself (with the client's own fields)."""
    api = client(embedded_server)
    with api.chat.completions.stream(
        model="deskchat",
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        # Parallel calls, the default: how many the model makes is its own choice (measured:
        # four in 127 tokens on the float32 cache, two in 63 on float16), so room for more.
        max_tokens=256,
    ) as stream:
        message = stream.get_final_completion().choices[0].message
    for call in message.tool_calls:
        assert call.function.name == "get_time"
        check_call(call)
    results = [
        {"role": "tool", "tool_call_id": c.id, "content": "12:00"} for c in message.tool_calls
    ]
    messages = [*ASK, message, *results]
    answer = api.chat.completions.create(
        model="deskchat", messages=messages, tools=TOOLS, tool_choice="none", max_tokens=8
    )
    assert answer.choices[0].finish_reason in ("stop", "length")


def test_chat_gives_the_same_call_in_its_shape(embedded_server):
    tools = [t["function"] for t in TOOLS]
    body = {"messages": ASK, "tools": tools, **ONE_CALL}
    reply = chat(embedded_server.url, body).json()
    assert reply["finish_reason"] == "tool_calls", reply
    whole = client(embedded_server).chat.completions.create(
        model="deskchat", messages=ASK, tools=TOOLS, **ONE_CALL
    )
    assert [(c["name"], json.dumps(c["arguments"])) for c in reply["tool_calls"]] == calls_of(whole)


def test_a_function_schema_llguidance_refuses_is_a_400_naming_it(embedded_server):
    parameters = {"type": "object", "properties": {"x": {"type": "strnig"}}}
    bad = {"type": "function", "function": {"name": "f", "parameters": parameters}}
    with pytest.raises(openai.BadRequestError) as caught:
        client(embedded_server).chat.completions.create(
            model="deskchat", messages=ASK, tools=[WEATHER, bad]
        )
    assert caught.value.body["param"] == "tools[1].function.parameters"
    assert "strnig" in caught.value.body["message"]


@pytest.mark.parametrize("max_tokens", [2, 12])
def test_a_forced_call_cut_by_max_tokens_is_no_text(embedded_server, max_tokens):
    """Issue 34: a forced answer holds calls and nothing else, also when max_tokens cuts it
    inside the opening tag (2 tokens: "<tool_call" came back as text before) or inside the
    call (12): no text content, finish_reason length, on both routes, whole and streamed."""
    api = client(embedded_server)
    forced = {"tools": TOOLS, "tool_choice": "required", "max_tokens": max_tokens}
    whole = api.chat.completions.create(model="deskchat", messages=ASK, **forced)
    [choice] = whole.choices
    assert choice.finish_reason == "length" and choice.message.content is None, choice
    chunks = list(
        api.chat.completions.create(model="deskchat", messages=ASK, stream=True, **forced)
    )
    texts = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert texts == [] and chunks[-1].choices[0].finish_reason == "length", chunks[-1]
    flat = {**forced, "tools": [t["function"] for t in TOOLS]}
    reply = chat(embedded_server.url, {"messages": ASK, **flat}).json()
    assert reply["response"] == "" and reply["finish_reason"] == "length", reply
    assert "tool_calls" not in reply  # /chat lists complete calls only
