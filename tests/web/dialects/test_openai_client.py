"""The official `openai` package, changed only in base_url and api_key, against the real
server.py with the embedded model on loopback."""

from __future__ import annotations

import threading

import openai
import pytest

from tests.support.httpclient import request, wait_until
from tests.support.servers import ServerProcess

pytestmark = pytest.mark.slow  # a server.py of its own (keys, one place in the queue)

KEY = "tool-key-" + "x" * 16
# Not France: SmolLM2's first token there is a near-tie in fp32 (0.08 logits) that the int8
# model may take either way; Japan's answer has 2.5 up to "Tokyo" (tests/support/margins.py).
ASK = [{"role": "user", "content": "What is the capital of Japan?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("openai")
    (tmp / "keys").write_text(f"# test keys\nclient-test:{KEY}\n")
    proc = ServerProcess(
        tmp,
        "--model",
        "embedded",
        "--api-keys-file",
        str(tmp / "keys"),
        "--max-queue",
        "1",
    )
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


def client(server, key: str = KEY, **options) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, **options)


def health(server) -> dict:
    return request(server.url, "GET", "/health").json()


def test_plain_and_streamed_answers_agree(server):
    api = client(server)
    plain = api.chat.completions.create(
        model="gpt-4o-mini", messages=ASK, temperature=0, max_tokens=24
    )
    answer = plain.choices[0].message.content
    assert "Tokyo" in answer and plain.choices[0].message.role == "assistant"
    assert plain.model == "SmolLM2-135M-Instruct"
    assert plain.choices[0].finish_reason in ("stop", "length")
    assert plain.usage.total_tokens == plain.usage.prompt_tokens + plain.usage.completion_tokens

    chunks = list(
        api.chat.completions.create(
            model="gpt-4o-mini",
            messages=ASK,
            temperature=0,
            max_tokens=24,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == answer
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-2].choices[0].finish_reason == plain.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == plain.usage.model_dump()


def test_same_seed_same_text(server):
    api = client(server)
    texts = [
        api.chat.completions.create(messages=ASK, model="m", temperature=1.0, seed=7, max_tokens=16)
        .choices[0]
        .message.content
        for _ in range(2)
    ]
    assert texts[0] == texts[1] and texts[0]


def test_models_list_and_retrieve(server):
    api = client(server)
    assert [m.id for m in api.models.list()] == ["SmolLM2-135M-Instruct"]
    assert api.models.retrieve("SmolLM2-135M-Instruct").owned_by == "deskchat"
    with pytest.raises(openai.NotFoundError):
        api.models.retrieve("gpt-4")


def test_bad_request_raises_bad_request_error(server):
    with pytest.raises(openai.BadRequestError) as refused:
        client(server).chat.completions.create(model="m", messages=ASK, n=2)
    assert refused.value.param == "n" and refused.value.code == "invalid_request"


def test_wrong_key_raises_authentication_error(server):
    with pytest.raises(openai.AuthenticationError):
        client(server, key="wrong-" + "y" * 20).models.list()


def test_full_queue_is_answered_by_the_clients_own_retry(server):
    api = client(server)
    count = [{"role": "user", "content": "Count from one to a thousand."}]
    # A list of at least 1,000 numbers cannot end within 1,000 tokens, whatever the model
    # would rather say (asked in words, the native step's greedy answer was 15 tokens).
    endless = {"type": "array", "items": {"type": "integer"}, "minItems": 1000}
    response_format = {"type": "json_schema", "json_schema": {"name": "n", "schema": endless}}
    batch = health(server)["batch"]["capacity"]
    long_streams = []
    for _ in range(batch):  # the whole batch runs, and runs until we hang up
        long_streams.append(
            api.chat.completions.create(
                model="m",
                messages=count,
                temperature=0,
                max_tokens=1000,
                response_format=response_format,
                stream=True,
            )
        )
        next(iter(long_streams[-1]))
    assert wait_until(lambda: health(server)["batch"]["running"] == batch, 10)
    queued = threading.Thread(
        target=lambda: api.chat.completions.create(model="m", messages=ASK, max_tokens=4)
    )
    queued.start()
    assert wait_until(lambda: health(server)["queue"]["depth"] == 1, 10)  # the queue is full
    refusals = server.log().count("status=503 error=overloaded")
    answers = []
    retrying = threading.Thread(
        target=lambda: answers.append(
            client(server, max_retries=2).chat.completions.create(
                model="m", messages=ASK, max_tokens=4
            )
        )
    )
    retrying.start()
    refused = lambda: server.log().count("status=503 error=overloaded") > refusals  # noqa: E731
    assert wait_until(refused, 10)  # its first try met the full queue
    for stream in long_streams:  # the batch frees; the client's retry (after Retry-After) gets in
        stream.close()
    retrying.join(70)
    queued.join(30)
    assert answers and answers[0].choices[0].message.content


def test_abandoned_stream_frees_the_worker(server):
    stream = client(server).chat.completions.create(
        model="m", messages=ASK, max_tokens=1000, stream=True
    )
    request_id = stream.response.headers["x-request-id"]
    chunks = iter(stream)
    for _ in range(3):
        next(chunks)
    assert health(server)["busy"]
    stream.close()
    assert wait_until(lambda: not health(server)["busy"], 5)
    assert wait_until(lambda: f"request {request_id} " in server.log(), 5)
    [line] = [line for line in server.log().splitlines() if f"request {request_id} " in line]
    assert "status=499" in line
