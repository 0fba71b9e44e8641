"""Reading an OpenAI chat.completions body into the one ChatRequest.

What the official client and LangChain send with their default settings is accepted. A field
we do not implement is accepted only with its no-op value (NO_OPS); any other value is a 400
naming the field, never silently ignored. `model` may name anything: one model is served,
and every answer names it. Sampling fields left out take the served defaults, as on /chat
(the model's generation_config.json, or greedy: `--sampling-defaults`), not OpenAI's
temperature 1; `repetition_penalty`, `top_k` and `min_p` are read as vLLM and llama-server
read them.
"""

from __future__ import annotations

from service.errors import InvalidRequest
from web.dialects import validation
from web.dialects.validation import ChatRequest

MAX_MODEL_CHARS = 256
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}

# Fields we take no action on, and the values under which that is exactly what OpenAI does.
NO_OPS: dict[str, tuple] = {
    "n": (None, 1),
    "logit_bias": (None, {}),
    "tools": (None, []),
    "tool_choice": (None, "none", "auto"),
    "parallel_tool_calls": (None, True, False),  # no tools: nothing to call in parallel
    "functions": (None, []),
    "function_call": (None, "none", "auto"),
    "modalities": (None, ["text"]),
    "store": (None, False),
    "metadata": (None, {}),
    "service_tier": (None, "auto", "default"),
    "user": None,  # any string: an end-user id for abuse tracking; we keep no such record
}
# Keys a message may carry only with these values.
MESSAGE_NO_OPS: dict[str, tuple] = {"name": (None,), "tool_calls": (None, []), "refusal": (None,)}
IMPLEMENTED = {
    *("messages", "model", "max_tokens", "max_completion_tokens"),
    *("stop", "stream", "stream_options", "response_format"),
    *validation.SAMPLING_FIELDS,
}


def _same(a, b) -> bool:
    """Equal as JSON values: 0 == 0.0 but False != 0."""
    return a == b and isinstance(a, bool) == isinstance(b, bool)


def _check_no_op(key: str, value, allowed: tuple | None) -> None:
    if allowed is None:  # any string
        if value is not None and not isinstance(value, str):
            raise InvalidRequest(f"'{key}' must be a string", param=key)
        return
    if not any(_same(value, ok) for ok in allowed):
        shown = ", ".join("null" if v is None else repr(v) for v in allowed)
        raise InvalidRequest(
            f"'{key}' is not supported by this server; leave it out or send one of: {shown}",
            param=key,
        )


def _content(value, where: str) -> str:
    """A string, or a list of text parts joined by newlines (other part types refused)."""
    if isinstance(value, list):
        texts = []
        for j, part in enumerate(value):
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or set(part)
                != {
                    "type",
                    "text",
                }
            ):
                raise InvalidRequest(
                    f'{where}[{j}] must be a text part {{"type": "text", "text": ...}}; '
                    "this server reads text only",
                    param="messages",
                )
            texts.append(part["text"] if isinstance(part["text"], str) else None)
        if None in texts or not texts:
            raise InvalidRequest(
                f"{where} must hold text parts with string 'text'", param="messages"
            )
        value = "\n".join(texts)
    return validation.text(value, where, "messages")


def _messages(raw) -> list[dict]:
    out = []
    for i, m in enumerate(validation.message_list(raw)):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise InvalidRequest(
                f"messages[{i}] must be an object with 'role' and 'content'", param="messages"
            )
        role = ROLES.get(m["role"]) if isinstance(m["role"], str) else None
        if role is None:
            raise InvalidRequest(
                f"messages[{i}].role {m['role']!r} is not one of {', '.join(ROLES)}",
                param="messages",
            )
        for key in set(m) - {"role", "content"}:
            if key not in MESSAGE_NO_OPS:
                raise InvalidRequest(f"messages[{i}] has an unknown key {key!r}", param="messages")
            _check_no_op(f"messages[{i}].{key}", m[key], MESSAGE_NO_OPS[key])
        out.append({"role": role, "content": _content(m["content"], f"messages[{i}].content")})
    return validation.check_turns(out)


def _max_tokens(body: dict) -> int | None:
    new = validation.positive_int(body.get("max_completion_tokens"), "max_completion_tokens")
    old = validation.positive_int(body.get("max_tokens"), "max_tokens")
    if new is not None and old is not None and new != old:
        raise InvalidRequest(
            "'max_tokens' and 'max_completion_tokens' disagree; send one of them",
            param="max_tokens",
        )
    return new if new is not None else old


def _stream_options(body: dict, stream: bool) -> bool:
    """Whether the stream ends with a usage chunk."""
    options = body.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise InvalidRequest("'stream_options' needs 'stream': true", param="stream_options")
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise InvalidRequest(
            "'stream_options' may hold only 'include_usage' (true or false)",
            param="stream_options",
        )
    return validation.flag(options, "include_usage")


def _response_format(value) -> validation.JsonSchema | None:
    """`text` (or nothing), `json_object`, or `json_schema` with its `schema`."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text" and set(value) == {"type"}:
        return None
    if kind == "json_object" and set(value) == {"type"}:
        return validation.JsonSchema(validation.ANY_OBJECT, "response_format")
    if kind == "json_schema" and set(value) == {"type", "json_schema"}:
        spec = value["json_schema"]
        if not isinstance(spec, dict) or "schema" not in spec:
            raise InvalidRequest(
                "'response_format.json_schema' must be an object with a 'schema'",
                param="response_format",
            )
        if set(spec) - {"name", "schema", "strict", "description"}:
            raise InvalidRequest(
                "'response_format.json_schema' may hold 'name', 'schema', 'strict' and "
                "'description' only",
                param="response_format",
            )
        return validation.json_schema(spec["schema"], "response_format")
    raise InvalidRequest(
        '\'response_format\' must be {"type": "text"}, {"type": "json_object"} or '
        '{"type": "json_schema", "json_schema": {"name", "schema"}}',
        param="response_format",
    )


def _model(body: dict) -> None:
    model = body.get("model")
    if model is not None and (not isinstance(model, str) or len(model) > MAX_MODEL_CHARS):
        raise InvalidRequest(
            f"'model' must be a string of at most {MAX_MODEL_CHARS} characters", param="model"
        )


def parse_completion_request(body) -> tuple[ChatRequest, bool]:
    """The checked request, and whether a stream should end with a usage chunk."""
    body = validation.known_fields(body, IMPLEMENTED | set(NO_OPS))
    for key, allowed in NO_OPS.items():
        if key in body:
            _check_no_op(key, body[key], allowed)
    _model(body)
    if "messages" not in body:
        raise InvalidRequest("'messages' is required", param="messages")
    stream = validation.flag(body, "stream")
    include_usage = _stream_options(body, stream)
    chat_request = ChatRequest(
        messages=_messages(body["messages"]),
        max_tokens=_max_tokens(body),
        stream=stream,
        stop=validation.stop(body),
        json=_response_format(body.get("response_format")),
        **validation.sampling(body),  # left out: the served defaults, as on /chat
    )
    return chat_request, include_usage
