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

from inference.runtime.tools import ToolUse
from service.errors import InvalidRequest
from web.checked_json import shown
from web.dialects import tools, validation
from web.dialects.validation import ChatRequest

ROLES = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
}

# Fields we take no action on, and the values under which that is exactly what OpenAI does.
NO_OPS: dict[str, tuple] = {
    "n": (None, 1),
    "functions": (None, []),  # the deprecated form of `tools`
    "function_call": (None, "none", "auto"),
    "modalities": (None, ["text"]),
    "store": (None, False),
    "metadata": (None, {}),
    "service_tier": (None, "auto", "default"),
    "user": None,  # any string: an end-user id for abuse tracking; we keep no such record
}
# Keys a message may carry only with these values.
MESSAGE_NO_OPS: dict[str, tuple] = {
    **{"name": (None,), "tool_calls": (None, []), "refusal": (None,)},
    **{"function_call": (None,), "audio": (None,), "annotations": (None, [])},
}
# What the official client's stream and parse helpers add to the messages they return (their
# own parse of the content and of each call's arguments, a streamed call's index): an agent
# loop sends such a message back as it is. Client-side data; read past.
CLIENT_ECHOES = {"parsed"}
THOUGHT_KEYS = {"reasoning_content", "reasoning"}  # an assistant turn's thought, sent back
CALL_ECHOES = {"index"}
FUNCTION_ECHOES = {"parsed_arguments"}
# reasoning_effort: "none" turns a thinking model's thought off, any other level on (this
# server has no levels between).
EFFORTS = ("none", "minimal", "low", "medium", "high")
IMPLEMENTED = {
    *("messages", "model", "max_tokens", "max_completion_tokens"),
    *("reasoning_effort", "chat_template_kwargs"),
    *("stop", "stream", "stream_options", "response_format", "logit_bias"),
    *("tools", "tool_choice", "parallel_tool_calls"),
    *validation.SAMPLING_FIELDS,
}
CHOICE_SHAPES = 'none, auto, required or {"type": "function", "function": {"name": ...}}'


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
    out = [_message(m, f"messages[{i}]") for i, m in enumerate(validation.message_list(raw))]
    tools.check_history(out)
    return validation.check_turns(out)


def _message(m, where: str) -> dict:
    """One message in the neutral form (inference/runtime/tools.py): an assistant's may
    carry `tool_calls` (then `content` may be null), a tool's result its `tool_call_id`."""
    calls = m.get("tool_calls") if isinstance(m, dict) and m.get("role") == "assistant" else None
    if not isinstance(m, dict) or "role" not in m or ("content" not in m and not calls):
        raise InvalidRequest(
            f"{where} must be an object with 'role' and 'content'", param="messages"
        )
    role = ROLES.get(m["role"]) if isinstance(m["role"], str) else None
    if role is None:
        raise InvalidRequest(
            f"{where}.role {shown(m['role'])} is not one of {', '.join(ROLES)}", param="messages"
        )
    own = {"tool_calls"} if calls else {"tool_call_id"} if role == "tool" else set()
    own |= THOUGHT_KEYS if role == "assistant" else set()
    for key in set(m) - {"role", "content"} - own - CLIENT_ECHOES:
        if key not in MESSAGE_NO_OPS:
            raise InvalidRequest(f"{where} has an unknown key {shown(key)}", param="messages")
        validation.check_no_op(f"{where}.{key}", m[key], MESSAGE_NO_OPS[key])
    content = m.get("content")
    thought = _thought(m, where)
    if calls:
        text = "" if content in (None, "") else _content(content, f"{where}.content")
        return {"role": role, "content": text, "tool_calls": _calls(calls, where), **thought}
    if role == "tool":
        text = "" if content == "" else _content(content, f"{where}.content")
        call_id = tools.call_id(m.get("tool_call_id"), f"{where}.tool_call_id")
        return {"role": role, "content": text, "tool_call_id": call_id}
    return {"role": role, "content": _content(content, f"{where}.content"), **thought}


def _thought(m: dict, where: str) -> dict:
    """An earlier answer's thought sent back (`reasoning_content`, or `reasoning`), as the
    template reads it."""
    for key in sorted(THOUGHT_KEYS & set(m)):
        if m[key] is not None:
            return {"reasoning_content": validation.reasoning(m[key], f"{where}.{key}")}
    return {}


def _think(body: dict) -> dict:
    """The thinking switch, as ChatRequest's fields: `chat_template_kwargs.enable_thinking`
    (vLLM's and llama-server's), else `reasoning_effort` ("none": off; a hint, which a model
    that does not think ignores)."""
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None:
        if not isinstance(kwargs, dict) or set(kwargs) - {"enable_thinking"}:
            raise InvalidRequest(
                "'chat_template_kwargs' may hold only 'enable_thinking' (true or false)",
                param="chat_template_kwargs",
            )
        switch = validation.think(kwargs.get("enable_thinking"), "chat_template_kwargs")
        if switch is not None:
            return {"think": switch, "think_param": "chat_template_kwargs"}
    effort = body.get("reasoning_effort")
    if effort is None:
        return {}
    if effort not in EFFORTS:
        raise InvalidRequest(
            f"'reasoning_effort' must be one of {', '.join(EFFORTS)}", param="reasoning_effort"
        )
    return {"think": effort != "none", "think_param": None}


def _calls(raw, where: str) -> list[dict]:
    """An assistant's `tool_calls`, each with its id and `arguments` a string holding a JSON
    object (or the object)."""
    return tools.typed_calls(
        raw, where, lambda given, at, _: tools.call_id(given, at), CALL_ECHOES, FUNCTION_ECHOES
    )


def _tool_choice(value) -> str | None:
    """None, "none", "auto", "required", or the name out of {"type": "function",
    "function": {"name": ...}}."""
    if value is None or value in tools.CHOICES:
        return value
    function = value.get("function") if isinstance(value, dict) else None
    if (
        isinstance(function, dict)
        and set(value) == {"type", "function"}
        and value["type"] == "function"
        and set(function) == {"name"}
    ):
        return tools.name(function["name"], "'tool_choice.function.name'", "tool_choice")
    raise InvalidRequest(f"'tool_choice' must be {CHOICE_SHAPES}", param="tool_choice")


def _tool_use(body: dict) -> ToolUse | None:
    raw = body.get("tools")
    functions = () if raw is None else tools.function_list(raw, tools.typed_function)
    return tools.tool_use(
        functions,
        _tool_choice(body.get("tool_choice")),
        body.get("parallel_tool_calls"),
        "tool_choice",
    )


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


def _logit_bias(value) -> tuple[tuple[int, float], ...]:
    """OpenAI's map of token ids (as strings) to an amount from -100 to 100 added to that
    token's logit, as (id, amount) pairs in id order. Whether each id is the model's is
    checked where the vocabulary is known (web/relay.py)."""
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise InvalidRequest(
            "'logit_bias' must be an object of token ids to numbers from -100 to 100",
            param="logit_bias",
        )
    bias: dict[int, float] = {}
    for key, amount in value.items():
        if not (key.isascii() and key.isdigit() and len(key) <= 10):
            raise InvalidRequest(
                f'\'logit_bias\' keys are token ids ("0", "15043", ...), got {shown(key)}',
                param="logit_bias",
            )
        token = int(key)
        if token in bias:
            raise InvalidRequest(f"'logit_bias' names token {token} twice", param="logit_bias")
        number = isinstance(amount, int | float) and not isinstance(amount, bool)
        if not number or not -100 <= amount <= 100:  # NaN fails the range too
            raise InvalidRequest(
                f"'logit_bias' of token {token} must be a number from -100 to 100",
                param="logit_bias",
            )
        bias[token] = float(amount)
    return tuple(sorted(bias.items()))


def parse_completion_request(body) -> tuple[ChatRequest, bool]:
    """The checked request, and whether a stream should end with a usage chunk."""
    body = validation.known_fields(body, IMPLEMENTED | set(NO_OPS))
    for key, allowed in NO_OPS.items():
        if key in body:
            validation.check_no_op(key, body[key], allowed)
    validation.model(body)
    if "messages" not in body:
        raise InvalidRequest("'messages' is required", param="messages")
    stream = validation.flag(body, "stream")
    include_usage = _stream_options(body, stream)
    tool_use = _tool_use(body)
    schema = _response_format(body.get("response_format"))
    if schema is not None and tool_use is not None:
        raise InvalidRequest(
            "'response_format' cannot be combined with 'tools' here (unless 'tool_choice' "
            'is "none")',
            param="response_format",
        )
    chat_request = ChatRequest(
        messages=_messages(body["messages"]),
        max_tokens=_max_tokens(body),
        stream=stream,
        stop=validation.stop(body),
        json=schema,
        tools=tool_use,
        logit_bias=_logit_bias(body.get("logit_bias")),
        **_think(body),
        **validation.sampling(body),  # left out: the served defaults, as on /chat
    )
    return chat_request, include_usage
