"""Issue 38's test of done: the official `ollama` package, changed only in its host and a
key header, against the real server.py with the embedded model (greedy): chat whole and
streamed, generate, a schema followed, a tool-call round trip, list, show and ps; a missing
key, a bad option and a model pull are errors the client reports. The answers are those of
/v1/chat/completions for the same messages and sampling. One server for the module."""

from __future__ import annotations

import json

import jsonschema
import ollama
import pytest

from tests.support import schemas
from tests.support.httpclient import request
from tests.support.servers import ServerProcess

KEY = "ollama-key-" + "x" * 16
MODEL = "SmolLM2-135M-Instruct"
# Japan's answer has a margin of 2.5 up to "Tokyo" on every step (tests/support/margins.py).
ASK = [{"role": "user", "content": "What is the capital of Japan?"}]
GREEDY = {"temperature": 0, "num_predict": 24}
WEATHER = {"type": "function", "function": schemas.WEATHER}
# SmolLM2-135M answers in text when it may choose; deskchat's option forces one call (Ollama
# would ignore it), with room for the longest city the schema allows.
ONE_CALL = {"tool_choice": "required", "parallel_tool_calls": False, "num_predict": 256}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ollama")
    (tmp / "keys").write_text(f"ollama-test:{KEY}\n")
    proc = ServerProcess(tmp, "--model", "embedded", "--api-keys-file", str(tmp / "keys"))
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


def client(server, key: str | None = KEY) -> ollama.Client:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return ollama.Client(host=server.url, headers=headers)


def test_chat_whole_and_streamed_agree_with_the_openai_route(server):
    api = client(server)
    whole = api.chat(model=MODEL, messages=ASK, options=GREEDY, stream=False)
    text = whole.message.content
    assert "Tokyo" in text and whole.message.role == "assistant" and whole.model == MODEL
    assert whole.done and whole.done_reason in ("stop", "length")
    assert whole.prompt_eval_count > 0 and 0 < whole.eval_count <= GREEDY["num_predict"]
    parts = [whole.load_duration, whole.prompt_eval_duration, whole.eval_duration]
    assert whole.prompt_eval_duration > 0 and whole.eval_duration > 0
    assert whole.total_duration >= sum(parts) * 0.99  # nanoseconds, each within the total

    streamed = list(api.chat(model=MODEL, messages=ASK, options=GREEDY, stream=True))
    assert "".join(p.message.content for p in streamed) == text
    assert [p.done for p in streamed] == [False] * (len(streamed) - 1) + [True]
    assert streamed[-1].done_reason == whole.done_reason
    assert streamed[-1].eval_count == whole.eval_count

    body = {"model": MODEL, "messages": ASK, "temperature": 0, "max_tokens": 24}
    headers = {"Authorization": f"Bearer {KEY}"}
    v1 = request(server.url, "POST", "/v1/chat/completions", body, headers=headers).json()
    assert v1["choices"][0]["message"]["content"] == text
    assert v1["usage"]["completion_tokens"] == whole.eval_count
    assert v1["usage"]["prompt_tokens"] == whole.prompt_eval_count


def test_sampling_options_mean_what_the_openai_fields_mean(server):
    options = {"temperature": 1.0, "seed": 7, "top_k": 20, "repeat_penalty": 1.3}
    ollama_text = (
        client(server)
        .chat(model=MODEL, messages=ASK, options={**options, "num_predict": 16})
        .message.content
    )
    body = {"model": MODEL, "messages": ASK, "max_tokens": 16, "temperature": 1.0, "seed": 7}
    body |= {"top_k": 20, "repetition_penalty": 1.3}
    headers = {"Authorization": f"Bearer {KEY}"}
    v1 = request(server.url, "POST", "/v1/chat/completions", body, headers=headers).json()
    assert v1["choices"][0]["message"]["content"] == ollama_text


def test_generate_is_the_prompt_as_the_users_turn(server):
    api = client(server)
    chat = api.chat(model=MODEL, messages=ASK, options=GREEDY).message.content
    whole = api.generate(model=MODEL, prompt=ASK[0]["content"], options=GREEDY)
    assert whole.response == chat and whole.done
    streamed = api.generate(model=MODEL, prompt=ASK[0]["content"], options=GREEDY, stream=True)
    assert "".join(p.response for p in streamed) == chat
    system = "You answer in French."
    other = api.generate(model=MODEL, prompt=ASK[0]["content"], system=system, options=GREEDY)
    v1_messages = [{"role": "system", "content": system}, *ASK]
    assert (
        other.response
        == api.chat(model=MODEL, messages=v1_messages, options=GREEDY).message.content
    )


def test_a_raw_prompt_is_read_as_the_model_reads_it(server, embedded_dir):
    from transformers import AutoTokenizer

    template = AutoTokenizer.from_pretrained(embedded_dir).apply_chat_template
    prompt = template(ASK, add_generation_prompt=True, tokenize=False)
    api = client(server)
    chat = api.chat(model=MODEL, messages=ASK, options=GREEDY)
    raw = api.generate(model=MODEL, prompt=prompt, raw=True, options=GREEDY)
    assert raw.response == chat.message.content
    assert raw.prompt_eval_count == chat.prompt_eval_count  # control tokens, not their names
    quoted = api.generate(model=MODEL, prompt=prompt, options=GREEDY)
    assert quoted.prompt_eval_count > chat.prompt_eval_count  # without raw: text in a turn


def test_structured_output_follows_the_schema(server):
    ask = [{"role": "user", "content": "Describe Alice, who is 30 years old, as JSON."}]
    reply = client(server).chat(
        model=MODEL,
        messages=ask,
        format=schemas.PERSON,
        options={"temperature": 0, "num_predict": 64},
    )
    assert reply.done_reason == "stop"
    jsonschema.validate(json.loads(reply.message.content), schemas.PERSON)


def test_a_tool_call_round_trip(server):
    api = client(server)
    ask = [{"role": "user", "content": "What is the weather in Paris right now?"}]
    first = api.chat(model=MODEL, messages=ask, tools=[WEATHER], options=ONE_CALL)
    [call] = first.message.tool_calls
    assert call.function.name == "get_weather" and isinstance(call.function.arguments, dict)
    jsonschema.validate(call.function.arguments, schemas.WEATHER["parameters"])
    assert first.done_reason == "stop"

    streamed = list(
        api.chat(model=MODEL, messages=ask, tools=[WEATHER], options=ONE_CALL, stream=True)
    )
    streamed_calls = [c for p in streamed for c in p.message.tool_calls or ()]
    assert streamed_calls == [call]

    result = {"role": "tool", "tool_name": "get_weather", "content": '{"weather": "sunny"}'}
    messages = [*ask, first.message, result]  # the message as the client returned it
    second = api.chat(
        model=MODEL, messages=messages, tools=[WEATHER], options={**GREEDY, "num_predict": 32}
    )
    assert second.message.content and not second.message.tool_calls


def test_list_show_and_ps_name_the_served_model(server):
    api = client(server)
    [listed] = api.list().models
    assert listed.model == MODEL
    health = request(server.url, "GET", "/health").json()
    assert listed.digest == health["weights_sha256"]
    shown = api.show(MODEL)
    assert "tools" in shown.capabilities and "--model" in shown.modelfile
    context = shown.modelinfo[f"{shown.modelinfo['general.architecture']}.context_length"]
    [running] = api.ps().models
    assert running.model == MODEL and running.context_length == context > 0
    with pytest.raises(ollama.ResponseError) as missing:
        api.show("llama3.2")
    assert missing.value.status_code == 404 and "llama3.2" in missing.value.error


def test_a_missing_key_is_a_401_the_client_reports(server):
    with pytest.raises(ollama.ResponseError) as refused:
        client(server, key=None).chat(model=MODEL, messages=ASK)
    assert refused.value.status_code == 401 and "API key" in refused.value.error
    with pytest.raises(ollama.ResponseError) as listed:
        client(server, key="wrong-" + "y" * 20).list()
    assert listed.value.status_code == 401


def test_a_bad_option_is_a_400_naming_it(server):
    with pytest.raises(ollama.ResponseError) as refused:
        client(server).chat(model=MODEL, messages=ASK, options={"repeat_penalty": "high"})
    assert refused.value.status_code == 400 and "options.repeat_penalty" in refused.value.error


def test_model_changes_are_refused_naming_the_flag(server):
    api = client(server)
    for change in (
        lambda: api.pull(MODEL),
        lambda: api.delete(MODEL),
        lambda: api.copy(MODEL, "b"),
    ):
        with pytest.raises(ollama.ResponseError) as refused:
            change()
        assert refused.value.status_code == 501 and "--model" in refused.value.error
