"""The sampling fields on both routes, with the scripted engine: what is refused (a 400
naming the field), what reaches the engine, the served defaults filling what a request
leaves out, and the shape of logprobs in answers and streams."""

from __future__ import annotations

import pytest

from inference.runtime.jobs import SamplingDefaults
from tests.support.fakes import FakeEngine
from tests.support.httpclient import Stream, request

HELLO = [{"role": "user", "content": "hello"}]
ROUTES = {
    "/chat": {"message": "hello"},
    "/v1/chat/completions": {"messages": HELLO},
}
# Qwen2.5-0.5B-Instruct's generation_config.json
QWEN = SamplingDefaults(0.7, 0.8, 20, 0.0, 1.1, source="generation_config.json")


def post(server, path: str, fields: dict):
    return request(server.url, "POST", path, {**ROUTES[path], **fields})


@pytest.mark.parametrize("path", list(ROUTES))
@pytest.mark.parametrize(
    "field, value",
    [
        ("frequency_penalty", 2.5),
        ("frequency_penalty", "0.5"),
        ("presence_penalty", -2.01),
        ("repetition_penalty", 0),
        ("repetition_penalty", 1e-300),  # its inverse overflowed the logits: a 500
        ("repetition_penalty", 0.09),
        ("repetition_penalty", -1.1),
        ("repetition_penalty", 11),
        ("top_k", -2),
        ("top_k", 1.5),
        ("top_k", True),
        ("min_p", 1.01),
        ("min_p", -0.1),
        ("logprobs", "yes"),
        ("top_logprobs", 21),
        ("top_logprobs", -1),
        ("top_logprobs", 3),  # without logprobs: true
    ],
)
def test_out_of_range_values_are_400_naming_the_field(fake_server, path, field, value):
    server = fake_server(FakeEngine(token_s=0.0))
    reply = post(server, path, {field: value})
    assert reply.status == 400, reply.body
    error = reply.json()["error"]
    assert f"'{field}'" in error["message"]
    if path.startswith("/v1"):
        assert error["param"] == field
    assert server.engine.ran == []


@pytest.mark.parametrize("path", list(ROUTES))
def test_every_field_reaches_the_engine(fake_server, path):
    server = fake_server(FakeEngine(token_s=0.0))
    fields = {
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 7,
        "min_p": 0.05,
        "repetition_penalty": 1.2,
        "frequency_penalty": -0.5,
        "presence_penalty": 2,
        "seed": 3,
        "logprobs": True,
        "top_logprobs": 20,
        "max_tokens": 1,
    }
    assert post(server, path, fields).status == 200
    sampling = server.engine.samplings[-1]
    for key, value in fields.items():
        assert getattr(sampling, key) == value, key


@pytest.mark.parametrize("path", list(ROUTES))
def test_what_a_request_leaves_out_comes_from_the_served_defaults(fake_server, path):
    server = fake_server(FakeEngine(token_s=0.0))
    assert post(server, path, {"max_tokens": 1}).status == 200
    greedy = server.engine.samplings[-1]  # no model defaults: greedy, no penalty
    assert (greedy.temperature, greedy.top_p, greedy.top_k) == (0.0, 1.0, 0)
    assert (greedy.min_p, greedy.repetition_penalty) == (0.0, 1.0)
    server.runtime.defaults = QWEN
    assert post(server, path, {"max_tokens": 1, "top_k": 0, "temperature": None}).status == 200
    sampling = server.engine.samplings[-1]
    assert (sampling.temperature, sampling.top_p, sampling.repetition_penalty) == (0.7, 0.8, 1.1)
    assert sampling.top_k == 0  # asked for: off, not the default 20
    assert post(server, path, {"max_tokens": 1, "top_k": -1}).status == 200
    assert server.engine.samplings[-1].top_k == 0  # vLLM's "off"
    assert post(server, path, {"max_tokens": 1, "temperature": 0}).status == 200
    assert server.engine.samplings[-1].temperature == 0.0  # greedy on request


def test_health_and_models_show_the_defaults_in_effect(fake_server):
    server = fake_server(FakeEngine())
    health = request(server.url, "GET", "/health").json()
    assert health["sampling_defaults"]["temperature"] == 0.0
    assert health["sampling_defaults"]["source"] == "greedy"
    server.runtime.defaults = QWEN
    expected = {**QWEN.values(), "source": "generation_config.json"}
    assert request(server.url, "GET", "/health").json()["sampling_defaults"] == expected
    [card] = request(server.url, "GET", "/v1/models").json()["data"]
    assert card["sampling_defaults"] == expected


def entry(token: str, logprob: float, top: int) -> dict:
    """The scripted engine's logprobs (tests/support/fakes.py), in OpenAI's shape."""
    alternatives = [
        {"token": token.upper(), "logprob": -1.0 - i, "bytes": list(token.upper().encode())}
        for i in range(top)
    ]
    return {
        "token": token,
        "logprob": logprob,
        "bytes": list(token.encode()),
        "top_logprobs": alternatives,
    }


def test_openai_answer_carries_logprobs_in_openais_shape(fake_server):
    server = fake_server(FakeEngine(token_s=0.0))
    body = {"logprobs": True, "top_logprobs": 2, "max_tokens": 2}
    choice = post(server, "/v1/chat/completions", body).json()["choices"][0]
    assert choice["message"]["content"] == "w1 w2 "
    content = [entry("w1 ", -0.5, 2), entry("w2 ", -0.5, 2)]
    assert choice["logprobs"] == {"content": content, "refusal": None}
    plain = post(server, "/v1/chat/completions", {"max_tokens": 2}).json()["choices"][0]
    assert plain["logprobs"] is None
    no_top = post(server, "/v1/chat/completions", {"logprobs": True, "max_tokens": 1}).json()
    assert no_top["choices"][0]["logprobs"]["content"] == [entry("w1 ", -0.5, 0)]


def test_openai_stream_chunks_carry_the_entries_of_their_tokens(fake_server):
    server = fake_server(FakeEngine(token_s=0.001))
    body = {"messages": HELLO, "logprobs": True, "top_logprobs": 1, "max_tokens": 3}
    stream = Stream(server.url, body, path="/v1/chat/completions")
    chunks = [data for _, data in stream.events() if data != "[DONE]"]
    stream.close()
    choices = [c["choices"][0] for c in chunks]
    assert choices[0]["logprobs"] is None  # the role chunk: no token
    texts = [c["delta"].get("content") for c in choices[1:-1]]
    entries = [e for c in choices[1:-1] for e in c["logprobs"]["content"]]
    assert "".join(texts) == "w1 w2 w3 " == "".join(e["token"] for e in entries)
    assert entries[2] == entry("w3 ", -0.5, 1)
    assert choices[-1]["finish_reason"] == "length" and choices[-1]["logprobs"] is None


def test_chat_answer_and_stream_carry_logprobs(fake_server):
    server = fake_server(FakeEngine(token_s=0.001))
    body = {"message": "hello", "logprobs": True, "top_logprobs": 1, "max_tokens": 2}
    reply = request(server.url, "POST", "/chat", body).json()
    assert reply["logprobs"] == [entry("w1 ", -0.5, 1), entry("w2 ", -0.5, 1)]
    assert "logprobs" not in request(server.url, "POST", "/chat", ROUTES["/chat"]).json()
    stream = Stream(server.url, body)
    events = [data for _, data in stream.events()]
    stream.close()
    pieces = [e for e in events if "delta" in e]
    assert [e["logprobs"] for e in pieces] == [[entry("w1 ", -0.5, 1)], [entry("w2 ", -0.5, 1)]]
    assert events[-1]["done"] is True


def official_client(server):
    """The openai package, unchanged, on the server's /v1, and a greedy ask of it."""
    import openai

    api = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    question = [{"role": "user", "content": "What is the capital of Japan?"}]
    return api, {"model": "m", "messages": question, "temperature": 0}


@pytest.mark.slow
def test_the_official_client_reads_logprobs_streamed_and_not(embedded_server):
    """The openai package, unchanged: its own types parse the entries, the extra fields go
    in extra_body, and a stream's chunks carry the entries the whole answer has."""
    api, ask = official_client(embedded_server)
    ask |= {
        "max_tokens": 12,
        "frequency_penalty": 0.3,
        "logprobs": True,
        "top_logprobs": 3,
        "extra_body": {"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1},
    }
    reply = api.chat.completions.create(**ask)
    content = reply.choices[0].logprobs.content
    assert b"".join(bytes(e.bytes) for e in content).decode() == reply.choices[0].message.content
    assert all(len(e.top_logprobs) == 3 and e.logprob <= 0 for e in content)
    chunks = list(api.chat.completions.create(**ask, stream=True))
    streamed = [
        entry
        for chunk in chunks
        if chunk.choices and chunk.choices[0].logprobs
        for entry in chunk.choices[0].logprobs.content
    ]
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in content]


@pytest.mark.parametrize(
    "value",
    [
        [[1, 5]],  # llama-server's list form: OpenAI's is an object
        {"hello": 5},
        {"-1": 5},
        {"": 5},
        {"1.0": 5},
        {"9" * 5000: 5},  # past what int() reads: a 400, not a 500
        {"1": 100.5},
        {"1": -101},
        {"1": "5"},
        {"1": True},
        {"1": None},
        {"7": 1, "07": 2},  # one token twice
        {str(0x110000): 1},  # past the (fake) tokenizer's ids
    ],
)
def test_logit_bias_outside_openais_shape_is_400(fake_server, value):
    server = fake_server(FakeEngine(token_s=0.0))
    reply = post(server, "/v1/chat/completions", {"logit_bias": value})
    assert reply.status == 400, reply.body
    error = reply.json()["error"]
    assert "'logit_bias'" in error["message"] and error["param"] == "logit_bias"
    assert server.engine.ran == []


def test_logit_bias_reaches_the_engine_in_token_order(fake_server):
    server = fake_server(FakeEngine(token_s=0.0))
    bias = {"7": 5, "3": -100, "1114111": 0.25}
    assert post(server, "/v1/chat/completions", {"logit_bias": bias, "max_tokens": 1}).status == 200
    assert server.engine.samplings[-1].logit_bias == ((3, -100.0), (7, 5.0), (1114111, 0.25))
    assert post(server, "/v1/chat/completions", {"logit_bias": {}, "max_tokens": 1}).status == 200
    assert server.engine.samplings[-1].logit_bias == ()
    reply = post(server, "/chat", {"logit_bias": bias})  # OpenAI's field, not /chat's
    assert reply.status == 400 and "logit_bias" in reply.json()["error"]["message"]


@pytest.mark.slow
def test_the_official_client_biases_the_real_model(embedded_server):
    """The openai package's own `logit_bias` (ids from /tokenize): +100 on three words
    keeps the answer to them, through the real server and model, streamed or not."""
    words = (" red", " green", " blue")
    ids = [request(embedded_server.url, "POST", "/tokenize", {"prompt": w}) for w in words]
    bias = {reply.json()["tokens"][0]: 100 for reply in ids}
    api, ask = official_client(embedded_server)
    ask |= {"max_tokens": 8, "logit_bias": bias}
    reply = api.chat.completions.create(**ask)
    text = reply.choices[0].message.content
    assert reply.usage.completion_tokens == 8 and set(text.split()) <= {"red", "green", "blue"}
    chunks = api.chat.completions.create(**ask, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text


def test_logit_bias_ids_stop_at_the_logits_width_where_the_tokenizer_has_more(fake_server):
    """A model may have fewer logit rows than its tokenizer has ids: such an id is a 400,
    never an IndexError in the worker."""
    server = fake_server(FakeEngine(token_s=0.0))
    server.runtime.logits_width = 1000
    reply = post(server, "/v1/chat/completions", {"logit_bias": {"1000": 1}})
    assert reply.status == 400 and "0 to 999" in reply.json()["error"]["message"]
    assert post(server, "/v1/chat/completions", {"logit_bias": {"999": 1}}).status == 200
