"""The /chat dialect: deskchat's own body and answer shapes, over the shared relay.

Body: `message` or `messages`, and optionally `system`, `max_tokens`, `stream`, `stop`,
`format` ("json" or a JSON schema, as in Ollama), `tools` (flat {"name", "description",
"parameters"} entries), `tool_choice` ("none", "auto", "required" or a tool's name),
`parallel_tool_calls`, and the sampling fields, named as on /v1 (`temperature`, `top_p`,
`top_k`, `min_p`, `repetition_penalty`, `frequency_penalty`, `presence_penalty`, `seed`,
`logprobs`, `top_logprobs`: validation.SAMPLING_FIELDS). Calls come back whole, arguments as
JSON objects. With `logprobs`, the answer and each stream event carry a `logprobs` list of
OpenAI's entries, for the text before any call. Errors: {"error": {"message", "type", "code":
<status>}}.
"""

from __future__ import annotations

from flask import Blueprint, g, jsonify, request

from inference.runtime.jobs import Done
from inference.runtime.tools import CallPiece, Function, ToolUse
from service.config import Config
from service.errors import InvalidRequest, ServiceError
from web import checked_json, relay
from web.checked_json import shown
from web.dialects import tools, validation
from web.dialects.validation import ChatRequest
from web.errors import status_of
from web.relay import Call, sse_frame
from web.runtime import Runtime

FIELDS = {"message", "messages", "system", "max_tokens", "stream", "stop", "format"}
FIELDS |= {"tools", "tool_choice", "parallel_tool_calls", "think"}
FIELDS |= validation.SAMPLING_FIELDS
MESSAGE_KEYS = {"user": set(), "system": set(), "assistant": {"tool_calls", "reasoning"}}
MESSAGE_KEYS["tool"] = {"tool_call_id"}


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
    out = [
        _message(m, f"messages[{i}]")
        for i, m in enumerate(validation.message_list(body["messages"]))
    ]
    tools.check_history(out)
    return validation.check_turns(out)


def _message(m, where: str) -> dict:
    """{"role", "content"}; an assistant's may add `tool_calls` ({"id", "name", "arguments":
    {...}} each; `content` may then be empty or left out), a tool's result `tool_call_id`."""
    keys = (
        MESSAGE_KEYS.get(m.get("role"))
        if isinstance(m, dict) and isinstance(m.get("role"), str)
        else None
    )
    if keys is None and isinstance(m, dict) and "role" in m:
        raise InvalidRequest(
            f"{where}.role {shown(m['role'])} is not one of {tuple(MESSAGE_KEYS)}", param="messages"
        )
    calls = m.get("tool_calls") if keys else None
    if keys is None or set(m) - {"role", "content"} - keys or ("content" not in m and not calls):
        raise InvalidRequest(
            f"{where} must be an object with 'role' and 'content'", param="messages"
        )
    role, content = m["role"], m.get("content")
    thought = {}
    if "reasoning" in m:  # an earlier answer's thought, sent back
        thought = {"reasoning_content": validation.reasoning(m["reasoning"], f"{where}.reasoning")}
    if calls is not None:
        text = (
            ""
            if content in (None, "")
            else validation.text(content, f"{where}.content", "messages")
        )
        return {"role": role, "content": text, "tool_calls": _calls(calls, where), **thought}
    if role == "tool":
        call_id = tools.call_id(m.get("tool_call_id"), f"{where}.tool_call_id")
        return {
            "role": role,
            "content": tools.result(content, f"{where}.content"),
            "tool_call_id": call_id,
        }
    text = validation.text(content, f"{where}.content", "messages")
    return {"role": role, "content": text, **thought}


def _calls(raw, where: str) -> list[dict]:
    if not isinstance(raw, list) or not raw or len(raw) > tools.MAX_TOOLS:
        raise InvalidRequest(
            f"{where}.tool_calls must be a list of 1-{tools.MAX_TOOLS} calls", param="messages"
        )
    out = []
    for j, call in enumerate(raw):
        at = f"{where}.tool_calls[{j}]"
        if not isinstance(call, dict) or set(call) != {"id", "name", "arguments"}:
            raise InvalidRequest(f'{at} must be {{"id", "name", "arguments"}}', param="messages")
        out.append(
            {
                "id": tools.call_id(call["id"], f"{at}.id"),
                "name": tools.name(call["name"], f"{at}.name", "messages"),
                "arguments": tools.arguments(call["arguments"], f"{at}.arguments"),
            }
        )
    return out


def _tool(entry, i: int) -> Function:
    where = f"tools[{i}]"
    if not isinstance(entry, dict) or set(entry) - {"name", "description", "parameters"}:
        raise InvalidRequest(
            f'{where} must be {{"name", "description", "parameters"}}', param=where
        )
    return tools.function(entry, where)


def _tool_use(body: dict) -> ToolUse | None:
    raw, choice = body.get("tools"), body.get("tool_choice")
    if choice is not None and not isinstance(choice, str):
        raise InvalidRequest(
            '\'tool_choice\' must be "none", "auto", "required" or a tool\'s name',
            param="tool_choice",
        )
    functions = () if raw is None else tools.function_list(raw, _tool)
    return tools.tool_use(functions, choice, body.get("parallel_tool_calls"), "tool_choice")


def parse_chat_request(body) -> ChatRequest:
    """The whole /chat body, checked; raises InvalidRequest naming the first problem."""
    body = validation.known_fields(body, FIELDS)
    system = body.get("system")
    tool_use, schema = _tool_use(body), validation.json_format(body.get("format"))
    if schema is not None and tool_use is not None:
        raise InvalidRequest(
            "'format' cannot be combined with 'tools' (unless 'tool_choice' is \"none\")",
            param="format",
        )
    return ChatRequest(
        messages=_messages(body),
        system=None if system is None else validation.text(system, "'system'", "system"),
        max_tokens=validation.positive_int(body.get("max_tokens"), "max_tokens"),
        stream=validation.flag(body, "stream"),
        stop=validation.stop(body),
        json=schema,
        tools=tool_use,
        think=validation.think(body.get("think"), "think"),
        **validation.sampling(body),
    )


def _done_fields(done: Done) -> dict:
    cut = {"thought_cut": True} if done.thought_cut else {}
    return {
        **cut,
        "finish_reason": done.finish_reason,
        "usage": {
            "prompt_tokens": done.usage.prompt_tokens,
            "completion_tokens": done.usage.completion_tokens,
        },
        "timings": done.timings(),
    }


def _tool_call(call: Call) -> dict:
    return {"id": call.id, "name": call.name, "arguments": checked_json.model_json(call.arguments)}


def _logprobs(entries) -> list[dict]:
    return [entry.as_dict() for entry in entries]


class ChatStream:
    """`data: {"id", "reasoning"}` per piece of a thinking model's thought, `data: {"id",
    "delta"}` per piece of text (with `logprobs` when asked: the entries of
    the tokens picked since the last event), `{"id", "tool_call": {"index", "id", "name",
    "arguments"}}` per call once it is whole, then `{"done": true, ...}` or `event: error`."""

    def __init__(self, request_id: str, model: str, logprobs: bool = False):
        self.request_id = request_id
        self.model = model
        self.logprobs = logprobs
        self._calls = relay.WholeCalls()

    def begin(self, first) -> list[str]:
        return []

    def thought(self, text: str) -> list[str]:
        return [sse_frame({"id": self.request_id, "reasoning": text})]

    def delta(self, text: str, logprobs: tuple = ()) -> list[str]:
        event = {"id": self.request_id, "delta": text}
        if self.logprobs:
            event["logprobs"] = _logprobs(logprobs)
        return [sse_frame(event)]

    def call(self, piece: CallPiece) -> list[str]:
        call = self._calls.feed(piece)
        if call is None:
            return []
        whole = {"index": piece.index, **_tool_call(call)}
        return [sse_frame({"id": self.request_id, "tool_call": whole})]

    def done(self, done: Done) -> list[str]:
        body = {"id": self.request_id, "model": self.model, "done": True, **_done_fields(done)}
        return [sse_frame(body)]

    def error(self, error: ServiceError) -> list[str]:
        return [sse_frame(error_body(error, status_of(error)), event="error")]


def blueprint(config: Config, runtime: Runtime) -> Blueprint:
    bp = Blueprint("chat", __name__)

    @bp.post("/chat", provide_automatic_options=False)
    def chat():
        chat_request = parse_chat_request(checked_json.parse_body(request.get_data(cache=False)))
        job, relayed = relay.start(chat_request, config, runtime, g.request_id, g.disconnected)
        if chat_request.stream:
            shape = ChatStream(job.id, runtime.model_name, chat_request.logprobs)
            return relay.sse(job, relayed, shape, g.log)
        answer = relay.collect(relayed, g.log)
        whole = [_tool_call(c) for c in answer.calls if c.complete]  # one cut short: left out
        body = {"id": job.id, "model": runtime.model_name, "response": answer.text}
        if answer.thought:
            body["reasoning"] = answer.thought
        if whole:
            body["tool_calls"] = whole
        if chat_request.logprobs:
            body["logprobs"] = _logprobs(answer.logprobs)
        return jsonify({**body, **_done_fields(answer.done)})

    return bp
