"""The /chat dialect: deskchat's own body and answer shapes, over the shared relay.

Body: `message` or `messages`, and optionally `system`, `max_tokens`, `temperature`, `top_p`,
`stream`, `stop`, `seed`, `format` ("json" or a JSON schema, as in Ollama).
Errors: {"error": {"message", "type", "code": <status>}}.
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

FIELDS = {"message", "messages", "system", "max_tokens", "temperature", "top_p", "stream"}
FIELDS |= {"stop", "seed", "format"}


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
        temperature=validation.temperature(body),
        top_p=validation.top_p(body),
        stream=validation.flag(body, "stream"),
        stop=validation.stop(body),
        seed=validation.seed(body.get("seed")),
        json=_format(body.get("format")),
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


class ChatStream:
    """`data: {"id", "delta"}` per piece, then `{"done": true, ...}` or `event: error`."""

    def __init__(self, request_id: str, model: str):
        self.request_id = request_id
        self.model = model

    def begin(self) -> list[str]:
        return []

    def delta(self, text: str) -> list[str]:
        return [sse_frame({"id": self.request_id, "delta": text})]

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
            return relay.sse(job, relayed, ChatStream(job.id, runtime.model_name), g.log)
        text, done = relay.collect(relayed, g.log)
        return jsonify(
            {"id": job.id, "model": runtime.model_name, "response": text, **_done_fields(done)}
        )

    return bp
