"""The /chat dialect: deskchat's own body and answer shapes, over the shared relay.

Body: `message` or `messages`, and optionally `system`, `max_tokens`, `stream`, `stop`,
`format` ("json" or a JSON schema, as in Ollama) and the sampling fields, named as on /v1
(`temperature`, `top_p`, `top_k`, `min_p`, `repetition_penalty`, `frequency_penalty`,
`presence_penalty`, `seed`, `logprobs`, `top_logprobs`: validation.SAMPLING_FIELDS).
With `logprobs`, the answer and each stream event carry a `logprobs` list of OpenAI's
entries. Errors: {"error": {"message", "type", "code": <status>}}.
"""

from __future__ import annotations

from flask import Blueprint, g, jsonify, request

from inference.runtime.jobs import Done
from service.config import Config
from service.errors import InvalidRequest, ServiceError
from web import relay
from web.dialects import validation
from web.dialects.validation import ROLES, ChatRequest
from web.errors import status_of
from web.relay import sse_frame
from web.runtime import Runtime

FIELDS = {"message", "messages", "system", "max_tokens", "stream", "stop", "format"}
FIELDS |= validation.SAMPLING_FIELDS


def error_body(error: ServiceError, status: int) -> dict:
    return {"error": {"message": error.message, "type": error.type, "code": status}}


def _messages(body: dict) -> list[dict]:
    has_one, has_list = "message" in body, "messages" in body
    if has_one == has_list:
        raise InvalidRequest("give exactly one of 'message' (a string) or 'messages' (a list)")
    if has_one:
        return [
            {"role": "user", "content": validation.text(body["message"], "'message'", "message")}
        ]
    out = []
    for i, m in enumerate(validation.message_list(body["messages"])):
        if not isinstance(m, dict) or set(m) != {"role", "content"}:
            raise InvalidRequest(
                f"messages[{i}] must be an object with 'role' and 'content'", param="messages"
            )
        if m["role"] not in ROLES:
            raise InvalidRequest(
                f"messages[{i}].role {m['role']!r} is not one of {ROLES}", param="messages"
            )
        content = validation.text(m["content"], f"messages[{i}].content", "messages")
        out.append({"role": m["role"], "content": content})
    return validation.check_turns(out)


def _format(value) -> validation.JsonSchema | None:
    """`format`: "json" for any JSON object, or a JSON schema the answer must follow."""
    if value is None:
        return None
    if value == "json":
        return validation.JsonSchema(validation.ANY_OBJECT, "format")
    return validation.json_schema(value, "format")


def parse_chat_request(body) -> ChatRequest:
    """The whole /chat body, checked; raises InvalidRequest naming the first problem."""
    body = validation.known_fields(body, FIELDS)
    system = body.get("system")
    return ChatRequest(
        messages=_messages(body),
        system=None if system is None else validation.text(system, "'system'", "system"),
        max_tokens=validation.positive_int(body.get("max_tokens"), "max_tokens"),
        stream=validation.flag(body, "stream"),
        stop=validation.stop(body),
        json=_format(body.get("format")),
        **validation.sampling(body),
    )


def _done_fields(done: Done) -> dict:
    return {
        "finish_reason": done.finish_reason,
        "usage": {
            "prompt_tokens": done.usage.prompt_tokens,
            "completion_tokens": done.usage.completion_tokens,
        },
        "timings": done.timings(),
    }


def _logprobs(entries) -> list[dict]:
    return [entry.as_dict() for entry in entries]


class ChatStream:
    """`data: {"id", "delta"}` per piece (with `logprobs` when asked: the entries of the
    tokens picked since the last event), then `{"done": true, ...}` or `event: error`."""

    def __init__(self, request_id: str, model: str, logprobs: bool = False):
        self.request_id = request_id
        self.model = model
        self.logprobs = logprobs

    def begin(self) -> list[str]:
        return []

    def delta(self, text: str, logprobs: tuple = ()) -> list[str]:
        event = {"id": self.request_id, "delta": text}
        if self.logprobs:
            event["logprobs"] = _logprobs(logprobs)
        return [sse_frame(event)]

    def done(self, done: Done) -> list[str]:
        body = {"id": self.request_id, "model": self.model, "done": True, **_done_fields(done)}
        return [sse_frame(body)]

    def error(self, error: ServiceError) -> list[str]:
        return [sse_frame(error_body(error, status_of(error)), event="error")]


def blueprint(config: Config, runtime: Runtime) -> Blueprint:
    bp = Blueprint("chat", __name__)

    @bp.post("/chat", provide_automatic_options=False)
    def chat():
        chat_request = parse_chat_request(validation.parse_json(request.get_data(cache=False)))
        job = relay.submit(chat_request, config, runtime, g.request_id)
        relayed = relay.events(job, g.disconnected)
        if chat_request.stream:
            shape = ChatStream(job.id, runtime.model_name, chat_request.logprobs)
            return relay.sse(job, relayed, shape, g.log)
        text, done, logprobs = relay.collect(relayed, g.log)
        answer = {"id": job.id, "model": runtime.model_name, "response": text}
        if chat_request.logprobs:
            answer["logprobs"] = _logprobs(logprobs)
        return jsonify({**answer, **_done_fields(done)})

    return bp
