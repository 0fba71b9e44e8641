"""No input ends in a 500: property tests over both dialects' validators and the sampler,
and a bounded HTTP fuzz run (fixed seed) against the scripted engine."""

from __future__ import annotations

import json
import os
import random
import time

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from inference.runtime.sampler import pick
from service.errors import InvalidRequest
from tests.support.fakes import FakeEngine
from tests.support.httpclient import request
from web.dialects.chat_api import parse_chat_request
from web.dialects.openai_request import parse_completion_request

FIELDS = [
    *("message", "messages", "system", "max_tokens", "max_completion_tokens", "temperature"),
    *("top_p", "stream", "stop", "seed", "format", "response_format", "n", "model", "user"),
    *("stream_options", "logprobs", "frequency_penalty", "tools"),
]
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**30), max_value=10**30),
    st.integers(min_value=-(10**400), max_value=10**400),  # too large for a float
    st.floats(allow_nan=False, allow_infinity=False),
    st.floats(min_value=0, max_value=1e-300),  # top_p that rounds to nothing
    st.text(max_size=20),
    st.sampled_from(["", " ", "user", "system", "assistant", "json", "text", "\ud800"]),
)
json_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(
            st.sampled_from([*FIELDS, "role", "content", "type", "text"]), inner, max_size=4
        )
    ),
    max_leaves=12,
)
messages = st.lists(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["user", "system", "assistant", "tool", 3]),
            "content": json_values,
        }
    ),
    max_size=3,
)
bodies = st.one_of(
    json_values,
    st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=6),
    st.fixed_dictionaries(
        {"messages": messages}, optional={k: json_values for k in FIELDS if k != "messages"}
    ),
    st.fixed_dictionaries(
        {"message": json_values}, optional={k: json_values for k in FIELDS if k != "message"}
    ),
)


@settings(max_examples=400, deadline=None)
@given(bodies)
def test_any_body_is_a_request_or_a_400(body):
    for parse in (parse_chat_request, parse_completion_request):
        try:
            parse(body)
        except InvalidRequest as exc:
            assert exc.message


@settings(max_examples=300, deadline=None)
@given(
    logits=st.lists(
        st.floats(min_value=-1e4, max_value=1e4, allow_nan=False), min_size=1, max_size=64
    ),
    temperature=st.floats(min_value=0, max_value=2),
    top_p=st.floats(min_value=0, max_value=1, exclude_min=True),
    seed=st.none() | st.integers(min_value=0, max_value=2**63),
)
def test_any_valid_sampling_gives_a_token(logits, temperature, top_p, seed):
    scores = torch.tensor(logits)
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    token = pick(scores, temperature, top_p, generator)
    assert 0 <= token < len(logits)
    if top_p < 1e-9 and temperature > 1e-3:  # only a most likely token is left (ties: any)
        probs = torch.softmax(scores / temperature, dim=-1)
        assert probs[token] == probs.max()


def fuzz_body(rng: random.Random) -> bytes:
    """A valid-looking body with one or two fields broken, or plain garbage."""
    base = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    odd = [None, True, -1, 0, 10**400, 1e308, "", "x" * 300, [], {}, [1], {"a": 1}, "\ud800"]
    roll = rng.random()
    if roll < 0.1:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(1, 40)))
    if roll < 0.2:
        return json.dumps(base).encode()[: rng.randrange(1, 40)]
    for _ in range(rng.randrange(1, 3)):
        base[rng.choice(FIELDS)] = rng.choice(odd)
    return json.dumps(base).encode()


# The suite sends 600 (within 60 s); DESKCHAT_FUZZ_REQUESTS=10000 makes the long run.
FUZZ_REQUESTS = int(os.environ.get("DESKCHAT_FUZZ_REQUESTS", "600"))


def test_http_fuzz_gets_no_500_and_always_an_answer(fake_server):
    server = fake_server(FakeEngine(token_s=0.0), "--max-queue", "2")
    rng = random.Random(20261130)
    deadline = time.monotonic() + max(60, FUZZ_REQUESTS / 10)
    statuses = []
    for i in range(FUZZ_REQUESTS):
        if time.monotonic() > deadline:
            break
        path = "/chat" if i % 2 else "/v1/chat/completions"
        reply = request(server.url, "POST", path, raw=fuzz_body(rng), timeout=10)
        statuses.append(reply.status)
        assert reply.status < 500 or reply.status == 503, (reply.status, reply.body)
        if reply.status >= 400:
            error = json.loads(reply.body)["error"]
            assert error["message"] and error["type"], reply.body
    assert len(statuses) >= FUZZ_REQUESTS // 2 and 200 in statuses and 400 in statuses
