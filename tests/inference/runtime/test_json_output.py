"""Answers constrained to JSON: the real embedded model through the real server, both
dialects, streamed and plain, and the official openai client's response_format."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.support.httpclient import chat, request, stream_all
from tests.support.schemas import CITY, ORDER, PERSON, TICKET, YES_NO

CASES = [
    (PERSON, "Alice is 31 years old. Give her name and age as JSON."),
    (PERSON, "Extract the person: 'Bob Smith, aged 45, lives in Leeds.'"),
    (PERSON, "Make up a person with a name and an age."),
    (PERSON, "My grandfather Tom turned 88 last week. Describe him as JSON."),
    (TICKET, "Classify this ticket: 'My laptop screen is cracked.'"),
    (TICKET, "Classify this ticket: 'The VPN keeps disconnecting every five minutes!'"),
    (TICKET, "Classify this ticket: 'Excel crashes when I open the budget file.'"),
    (TICKET, "Classify this ticket: 'Can I get a new chair?'"),
    (CITY, "Describe Paris as JSON."),
    (CITY, "Describe Tokyo as JSON."),
    (CITY, "Describe London with two landmarks."),
    (CITY, "Tell me about Rome."),
    (ORDER, "Jane ordered 2 apples and 3 pears. Write the order."),
    (ORDER, "Order for Sam (sam@example.com): one keyboard."),
    (ORDER, "Create an order for Lee with three items of your choice."),
    (ORDER, "Mark wants 10 pens and 1 notebook."),
    (YES_NO, "Is the sky blue?"),
    (YES_NO, "Is 7 an even number?"),
    (YES_NO, "Is Paris the capital of France?"),
    (YES_NO, "Can fish fly?"),
]


@pytest.fixture(scope="module")
def server(embedded_server):
    return embedded_server


def completion(server, body: dict):
    return request(server.url, "POST", "/v1/chat/completions", body, timeout=180)


@pytest.mark.parametrize("schema, prompt", CASES)
def test_answers_follow_the_schema(server, schema, prompt):
    body = {
        "messages": [{"role": "user", "content": prompt}],
        # Room for the longest answers the schemas allow: ORDER's four 40-character product
        # names alone can pass 200 tokens, where a loop-prone small model goes.
        "max_tokens": 1024,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
    }
    reply = completion(server, body)
    assert reply.status == 200, reply.body
    choice = reply.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    jsonschema.validate(json.loads(choice["message"]["content"]), schema)


def test_a_constrained_answer_cut_by_max_tokens_says_length(server):
    body = {"message": "Describe Tokyo as JSON.", "format": CITY, "max_tokens": 5}
    reply = chat(server.url, body).json()
    assert reply["finish_reason"] == "length" and reply["usage"]["completion_tokens"] == 5


def test_compiled_schemas_are_cached(embedded_dir):
    from transformers import AutoTokenizer

    from inference.runtime.grammar import SchemaCompiler

    tokenizer = AutoTokenizer.from_pretrained(embedded_dir)
    compiler = SchemaCompiler(lambda use: use(tokenizer), 49152)
    first = compiler.compile(PERSON, "format")
    assert compiler.compile(dict(PERSON), "format") is first
    assert compiler.compile(TICKET, "format") is not first


def test_json_object_alone_gives_an_object(server):
    body = {
        "messages": [
            {
                "role": "user",
                "content": "Return a JSON object with the fields city and country for Paris.",
            }
        ],
        "max_tokens": 200,
        "response_format": {"type": "json_object"},
    }
    reply = completion(server, body)
    assert reply.status == 200, reply.body
    choice = reply.json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice  # not cut by max_tokens
    assert isinstance(json.loads(choice["message"]["content"]), dict)


def test_chat_format_json_and_schema(server):
    ask = "Return a JSON object with the fields city and country for Paris."
    plain = chat(server.url, {"message": ask, "format": "json", "max_tokens": 200}).json()
    assert plain["finish_reason"] == "stop", plain
    assert isinstance(json.loads(plain["response"]), dict)
    body = {"message": "Is the sky blue?", "format": YES_NO, "max_tokens": 20}
    jsonschema.validate(json.loads(chat(server.url, body).json()["response"]), YES_NO)


def test_streamed_constrained_answer_equals_the_plain_one(server):
    body = {"message": "Describe Paris as JSON.", "format": CITY, "max_tokens": 200}
    plain = chat(server.url, body).json()["response"]
    streamed, _ = stream_all(server.url, body)
    assert streamed == plain
    jsonschema.validate(json.loads(plain), CITY)


@pytest.mark.parametrize(
    "schema, says",
    [
        ({"type": "strnig"}, "strnig"),
        ({"type": "object", "properties": {"a": {"$ref": "#/defs/missing"}}}, "/defs/missing"),
        ({"type": "string", "pattern": "(["}, "regex"),
    ],
)
def test_a_schema_that_cannot_be_compiled_is_400_saying_why(server, schema, says):
    spec = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    reply = completion(
        server, {"messages": [{"role": "user", "content": "hi"}], "response_format": spec}
    )
    assert reply.status == 400
    error = reply.json()["error"]
    assert error["param"] == "response_format" and says in error["message"]
    reply = chat(server.url, {"message": "hi", "format": schema})
    assert reply.status == 400 and says in reply.json()["error"]["message"]


def test_a_schema_no_value_satisfies_is_400(server):
    impossible = {"type": "integer", "minimum": 5, "maximum": 2}
    reply = chat(server.url, {"message": "A number?", "format": impossible})
    assert reply.status == 400 and reply.json()["error"]["type"] == "invalid_request"
    assert chat(server.url, {"message": "Hi", "max_tokens": 4}).status == 200  # the worker goes on


def test_the_openai_client_response_format(server):
    api = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    reply = api.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "Classify: 'The printer is out of toner.'"}],
        max_tokens=150,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "ticket", "schema": TICKET, "strict": True},
        },
    )
    jsonschema.validate(json.loads(reply.choices[0].message.content), TICKET)
