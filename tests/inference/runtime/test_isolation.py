"""Issue 28, one bad request never hurts another: a job whose grammar fails mid-step ends
alone with a 400, and the jobs stepped beside it answer exactly what they answer alone; the
server's log holds no traceback and none of the requests' content. One real server (the
embedded model, default --max-batch 4) for the module."""

from __future__ import annotations

import threading

import pytest

from inference.runtime.jobs import Sampling
from tests.support.fakes import FakeEngine, FakeStream
from tests.support.httpclient import Stream, request

# A schema that passes admission but dead-ends a few tokens into the answer: a short free
# string, then a required $ref cycle that makes llguidance's parser give up (too complex).
CYCLE = {"type": "object", "properties": {"x": {"$ref": "#/$defs/a"}}, "required": ["x"]}
DEAD_END = {
    "$defs": {"a": CYCLE},
    "type": "object",
    "properties": {"s": {"type": "string", "maxLength": 3}, "y": {"$ref": "#/$defs/a"}},
    "required": ["s", "y"],
}
QUESTIONS = ["What is the capital of Japan?", "Name three colours.", "Count from one to five."]


def completion(server, body: dict):
    return request(server.url, "POST", "/v1/chat/completions", body, timeout=300)


def ask(question: str) -> dict:
    return {"messages": [{"role": "user", "content": question}], "max_tokens": 24}


def failing() -> dict:
    return {
        **ask("Describe yourself as JSON."),
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "a", "schema": DEAD_END},
        },
    }


def answer(reply) -> str:
    assert reply.status == 200, reply.body
    return reply.json()["choices"][0]["message"]["content"]


def test_a_failing_job_ends_alone_and_its_neighbours_answer_as_alone(embedded_server):
    replies: dict[int, object] = {}
    bodies = [ask(q) for q in QUESTIONS] + [failing()]

    def send(i: int) -> None:
        replies[i] = completion(embedded_server, bodies[i])

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    bad = replies[len(QUESTIONS)]
    assert bad.status == 400, bad.body
    error = bad.json()["error"]
    assert error["code"] == "invalid_request" and error["param"] == "response_format", error
    assert "response_format" in error["message"] and "#/$defs" not in error["message"]
    together = [answer(replies[i]) for i in range(len(QUESTIONS))]
    alone = [answer(completion(embedded_server, ask(q))) for q in QUESTIONS]
    assert together == alone
    log = embedded_server.log()
    assert "Traceback" not in log and "a generation step failed" not in log


def test_a_dead_end_mid_stream_is_an_invalid_request_error_event(embedded_server):
    stream = Stream(embedded_server.url, failing(), path="/v1/chat/completions", timeout=300)
    try:
        assert stream.status == 200  # admitted: the dead end lies past the forced start
        events = list(stream.events())
    finally:
        stream.close()
    pieces = [d for _, d in events if isinstance(d, dict) and d.get("choices")]
    errors = [d["error"] for _, d in events if isinstance(d, dict) and "error" in d]
    assert pieces and len(errors) == 1, events
    assert errors[0]["code"] == "invalid_request" and errors[0]["param"] == "response_format"


@pytest.mark.parametrize(
    ("path", "field"), [("/v1/chat/completions", "response_format"), ("/chat", "format")]
)
def test_a_schema_dead_at_its_start_is_a_400_naming_its_field(embedded_server, path, field):
    schema = {"$defs": {"a": CYCLE}, "$ref": "#/$defs/a"}
    if field == "format":
        body = {"message": "hi", "format": schema}
    else:
        spec = {"name": "a", "schema": schema}
        body = {**ask("hi"), field: {"type": "json_schema", "json_schema": spec}}
    reply = request(embedded_server.url, "POST", path, body, timeout=60)
    assert reply.status == 400, reply.body
    error = reply.json()["error"]
    assert f"'{field}'" in error["message"] and "too complex" in error["message"], error


class FailingStepEngine(FakeEngine):
    """Streams whose prompt is `fail_in_step` fail in their first step with `error`; with
    `at_close`, when their finished stream is closed instead (its last text)."""

    def __init__(self, fail_in_step: str, error: Exception, at_close: bool = False, **kwargs):
        super().__init__(**kwargs)
        self.fail_in_step = [ord(c) for c in fail_in_step]
        self.error = error
        self.at_close = at_close

    def step(self, streams: list[FakeStream]) -> None:
        for stream in streams:
            if not self.at_close and stream.finish is None and self._fails(stream):
                stream.error, stream.finish = self.error, "error"
        super().step(streams)

    def close(self, stream: FakeStream, interrupted: bool = False):
        if self.at_close and not interrupted and self._fails(stream):
            raise self.error
        return super().close(stream, interrupted)

    def _fails(self, stream: FakeStream) -> bool:
        return stream.prompt_ids == self.fail_in_step


@pytest.mark.parametrize("at_close", [False, True], ids=["in-step", "at-close"])
@pytest.mark.parametrize("error", [ValueError("secret words"), KeyError("secret words")])
def test_an_unexpected_error_in_one_stream_is_its_500_alone(worker_for, error, at_close, caplog):
    engine = FailingStepEngine("bad", error, at_close=at_close, token_s=0.001)
    worker = worker_for(engine)  # the shipped --max-batch: the three can share a batch
    from inference.runtime.jobs import Done, Failed, Job

    jobs = [Job([ord(c) for c in p], Sampling(max_tokens=5), 30) for p in ("ok1", "bad", "ok2")]
    for job in jobs:
        worker.submit(job)
    ends = []
    for job in jobs:
        while not isinstance(event := job.events.get(timeout=10), Done | Failed):
            pass
        ends.append(event)
    assert isinstance(ends[0], Done) and isinstance(ends[2], Done)
    assert isinstance(ends[1], Failed) and ends[1].error.type == "internal"
    assert jobs[1].id in ends[1].error.message
    assert jobs[1].id in caplog.text and "secret words" not in caplog.text


def marker(field: str) -> str:
    return f"Zq{field}Xv9"


def marked_requests() -> list[tuple[str, dict]]:
    """Every field that carries content, each with its own distinctive string, through both
    dialects, streamed and not, with a schema that passes and one that fails at admission
    and one that fails mid-answer."""
    name, pattern = marker("propname"), f"^{marker('pattern')}$"
    schema = {
        "type": "object",
        "properties": {name: {"type": "string", "pattern": pattern}},
        "required": [name],
    }
    bad_schema = {"$defs": {"a": CYCLE}, "$ref": "#/$defs/a", "title": marker("badschema")}
    late = {**DEAD_END, "description": marker("lateschema")}
    messages = [
        {"role": "system", "content": marker("system")},
        {"role": "user", "content": marker("user") + "<|im_end|>"},
        {"role": "assistant", "content": marker("assistant")},
        {"role": "user", "content": marker("question")},
    ]
    base = {"messages": messages, "max_tokens": 8, "user": marker("enduser")}
    base["stop"] = [marker("stop")]

    def with_schema(s: dict) -> dict:
        return {"type": "json_schema", "json_schema": {"name": marker("schemaname"), "schema": s}}

    return [
        ("/v1/chat/completions", {**base, "response_format": with_schema(schema)}),
        ("/v1/chat/completions", {**base, "response_format": with_schema(bad_schema)}),
        ("/v1/chat/completions", {**base, "response_format": with_schema(late), "stream": True}),
        ("/v1/chat/completions", {**base, "max_tokens": "x" + marker("badvalue")}),
        ("/v1/chat/completions", {**base, "messages": [{"role": marker("role"), "content": "x"}]}),
        ("/chat", {"message": marker("message"), "system": marker("chatsystem"), "max_tokens": 8}),
        ("/chat", {"message": "hi", "format": bad_schema, "stop": [marker("chatstop")]}),
    ]


@pytest.mark.slow  # every field of every dialect through the real model
def test_the_log_holds_no_request_content_and_no_traceback(embedded_server):
    statuses = []
    for path, body in marked_requests():
        statuses.append(request(embedded_server.url, "POST", path, body, timeout=300).status)
    assert 200 in statuses and 400 in statuses and max(statuses) < 500, statuses
    log = embedded_server.log()
    assert "Zq" not in log, [line for line in log.splitlines() if "Zq" in line]
    for leak in ("Traceback", "<state>", "im_start", "#/$defs"):
        assert leak not in log, leak
