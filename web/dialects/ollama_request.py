"""Reading Ollama's /api/chat and /api/generate bodies into the one ChatRequest.

What the official `ollama` client sends is accepted. In `options`, the sampling options
deskchat implements (OPTIONS, `num_predict`, `stop`) are checked, and a wrong type or range
is a 400 naming `options.NAME`; any other option is ignored, as Ollama ignores options it
does not know (`num_ctx`, `mirostat`, ...: the server's own settings decide those here);
deskchat adds `tool_choice` and `parallel_tool_calls`, which Ollama would ignore.
Top-level fields we take no action on are accepted only with their no-op values (NO_OPS);
an unknown field is a 400, as on the other routes. `model` may name anything, as on /v1.
Images are refused: the served model reads text only.

Ollama's messages carry no call ids: a tool result names its function (`tool_name`) or
answers the first unanswered call of the assistant turn before it. Each call gets an id here
(`call_<turn>_<index>`, unless it brought one), so the neutral form (inference/runtime/tools.py)
links results to calls as it does for the other dialects.
"""

from __future__ import annotations

from inference.runtime.tools import ToolUse
from service.errors import InvalidRequest
from web.checked_json import shown
from web.dialects import tools, validation
from web.dialects.validation import ChatRequest

# Ollama's sampling options and the fields validation.sampling() reads for them.
OPTIONS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repeat_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "seed": "seed",
}
OPTION_NAMES = {ours: f"options.{theirs}" for theirs, ours in OPTIONS.items()}
RANDOM_SEED = -1  # Ollama's default seed: a fresh one each time, as a request without one
NUM_PREDICT_NO_LIMIT = (-1, -2)  # Ollama: no limit, fill the context
# Asked for no limit: the budget (inference/runtime/budget.py) cuts this to
# --max-tokens-cap and to what the context leaves.
NO_LIMIT = 2**31 - 1
COMMON_FIELDS = {"model", "stream", "format", "options", "keep_alive", "think"}
COMMON_FIELDS |= {"logprobs", "top_logprobs"}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "tools"}
GENERATE_FIELDS = COMMON_FIELDS | {"prompt", "system", "raw", "images", "suffix", "template"}
GENERATE_FIELDS |= {"context"}
# Fields we take no action on, and the values under which that is what Ollama does with a
# text model: no fill-in-the-middle, no template of the request's own, no context carried
# over from an earlier /api/generate.
NO_OPS: dict[str, tuple] = {
    "suffix": (None, ""),
    "template": (None, ""),
    "context": (None, []),
}
ROLES = ("system", "user", "assistant", "tool")
THINK_LEVELS = ("low", "medium", "high")  # Ollama's levels (gpt-oss'): here all mean on
MESSAGE_KEYS = {"role", "content", "images", "thinking"}
ROLE_KEYS = {"assistant": {"tool_calls"}, "tool": {"tool_name"}}


def _no_images(value, where: str) -> None:
    if value not in (None, []):
        raise InvalidRequest(
            f"{where}: images are not supported; the served model reads text only",
            param="images" if where == "'images'" else "messages",
        )


def _keep_alive(value) -> None:
    """Accepted and without effect: the model stays loaded as long as the server runs."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, str | int | float)):
        raise InvalidRequest(
            "'keep_alive' must be a duration (\"5m\", a number of seconds, or -1)",
            param="keep_alive",
        )


def _think(value) -> bool | None:
    """`think`: true, false, or a level (on)."""
    if value in THINK_LEVELS:
        return True
    if value is not None and not isinstance(value, bool):
        raise InvalidRequest(
            f"'think' must be true, false or one of {', '.join(THINK_LEVELS)}", param="think"
        )
    return value


def _options(value) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidRequest("'options' must be an object", param="options")
    return value


def _num_predict(options: dict) -> int | None:
    value = options.get("num_predict")
    if value is None:
        return None
    if validation.is_int(value) and value in NUM_PREDICT_NO_LIMIT:
        return NO_LIMIT
    if not validation.is_int(value) or value < 1:
        raise InvalidRequest(
            "'options.num_predict' must be a positive integer, or -1 (no limit) or -2 "
            "(fill the context)",
            param="options.num_predict",
        )
    return value


def _sampling(body: dict, options: dict) -> dict:
    """The options deskchat implements, checked under their Ollama names; `logprobs` and
    `top_logprobs` are top-level fields in Ollama."""
    fields = {ours: options[theirs] for theirs, ours in OPTIONS.items() if theirs in options}
    seed = fields.get("seed")
    if validation.is_int(seed) and seed == RANDOM_SEED:
        del fields["seed"]
    fields["logprobs"] = body.get("logprobs")
    fields["top_logprobs"] = body.get("top_logprobs")
    return validation.sampling(fields, OPTION_NAMES)


def _format(value) -> validation.JsonSchema | None:
    """`format`: "" or left out for text, "json", or a JSON schema."""
    return None if value == "" else validation.json_format(value)


def _common(body, fields: set[str]) -> dict:
    """What both routes share, checked, as ChatRequest's keyword arguments."""
    body = validation.known_fields(body, fields)
    for key, allowed in NO_OPS.items():
        if key in body:
            validation.check_no_op(key, body[key], allowed)
    _no_images(body.get("images"), "'images'")
    validation.model(body)
    _keep_alive(body.get("keep_alive"))
    options = _options(body.get("options"))
    return {
        # Ollama streams unless told not to
        "stream": True if body.get("stream") is None else validation.flag(body, "stream"),
        "json": _format(body.get("format")),
        "max_tokens": _num_predict(options),
        "stop": validation.stop(options, "options.stop"),
        "think": _think(body.get("think")),
        **_sampling(body, options),
    }


def _answered(unanswered: list[dict], tool_name, where: str) -> str:
    """The id of the call a tool result answers: the first unanswered call of the turn
    before it, of the function `tool_name` names when it names one."""
    wanted = None if tool_name is None else tools.name(tool_name, f"{where}.tool_name", "messages")
    for k, call in enumerate(unanswered):
        if wanted is None or call["name"] == wanted:
            return unanswered.pop(k)["id"]
    of = f" of {wanted!r}" if wanted else ""
    raise InvalidRequest(
        f"{where} is a tool result, but the assistant message before it has no unanswered call{of}",
        param="messages",
    )


def _calls(raw, where: str, turn: int) -> list[dict]:
    """An assistant's `tool_calls`: {"function": {"name", "arguments": {...}}} each (an
    `id`, a `type` and the function's `index` may come along); one without an id gets
    `call_<turn>_<index>`."""

    def identify(given, at: str, j: int) -> str:
        return f"call_{turn}_{j}" if given is None else tools.call_id(given, at)

    return tools.typed_calls(raw, where, identify, function_keys={"index"})


def _message(m, where: str, turn: int) -> dict:
    """One message in the neutral form; a tool result's `tool_call_id` is linked later."""
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise InvalidRequest(
            f"{where} must be an object with 'role' and 'content'", param="messages"
        )
    role = m["role"]
    if role not in ROLES:
        raise InvalidRequest(
            f"{where}.role {shown(role)} is not one of {', '.join(ROLES)}", param="messages"
        )
    unknown = sorted(set(m) - MESSAGE_KEYS - ROLE_KEYS.get(role, set()))
    if unknown:
        raise InvalidRequest(f"{where} has an unknown key {shown(unknown[0])}", param="messages")
    _no_images(m.get("images"), f"{where}.images")
    thought = {}
    if m.get("thinking") not in (None, "") and role == "assistant":  # an answer's, sent back
        thought = {"reasoning_content": validation.reasoning(m["thinking"], f"{where}.thinking")}
    else:
        validation.check_no_op(f"{where}.thinking", m.get("thinking"), (None, ""))
    content, calls = m.get("content"), m.get("tool_calls")
    if calls:
        text = (
            ""
            if content in (None, "")
            else validation.text(content, f"{where}.content", "messages")
        )
        return {"role": role, "content": text, "tool_calls": _calls(calls, where, turn), **thought}
    if role == "tool":
        return {"role": role, "content": tools.result(content or "", f"{where}.content")}
    text = validation.text(content, f"{where}.content", "messages")
    return {"role": role, "content": text, **thought}


def _messages(raw) -> list[dict]:
    out: list[dict] = []
    unanswered: list[dict] = []  # calls of the last assistant turn not answered yet
    for i, m in enumerate(validation.message_list(raw)):
        where = f"messages[{i}]"
        message = _message(m, where, i)
        if message["role"] == "tool":
            message["tool_call_id"] = _answered(unanswered, m.get("tool_name"), where)
        else:
            unanswered = list(message.get("tool_calls", ()))
        out.append(message)
    tools.check_history(out)
    return validation.check_turns(out)


def _tool_use(raw, options: dict) -> ToolUse | None:
    """`tools`, and what the answer may do with them: Ollama lets the model choose; the
    options `tool_choice` and `parallel_tool_calls` (deskchat's, read as on /chat; Ollama
    ignores them) can force a call, which a small model may need."""
    functions = () if raw is None else tools.function_list(raw, tools.typed_function)
    choice = options.get("tool_choice")
    if choice is not None and not isinstance(choice, str):
        raise InvalidRequest(
            '\'options.tool_choice\' must be "none", "auto", "required" or a tool\'s name',
            param="options.tool_choice",
        )
    return tools.tool_use(
        functions, choice, options.get("parallel_tool_calls"), "options.tool_choice"
    )


def parse_chat_request(body) -> ChatRequest | None:
    """The checked /api/chat request; None when it has no messages (Ollama's way to load a
    model, answered at once)."""
    common = _common(body, CHAT_FIELDS)
    tool_use = _tool_use(body.get("tools"), _options(body.get("options")))
    if common["json"] is not None and tool_use is not None:
        raise InvalidRequest("'format' cannot be combined with 'tools' here", param="format")
    if body.get("messages") in (None, []):
        return None
    return ChatRequest(messages=_messages(body["messages"]), tools=tool_use, **common)


def parse_generate_request(body) -> ChatRequest | None:
    """The checked /api/generate request: `prompt` as the user's turn of a chat, `system`
    in place of the system turn, or with `raw` the prompt as the model reads it; None when
    the prompt is empty (a load, as in Ollama)."""
    common = _common(body, GENERATE_FIELDS)
    prompt, system = body.get("prompt"), body.get("system")
    raw = validation.flag(body, "raw")
    if raw and system not in (None, ""):
        raise InvalidRequest(
            "'system' has no effect with 'raw': write the system turn into the prompt",
            param="system",
        )
    if prompt in (None, ""):
        return None
    user = {"role": "user", "content": validation.text(prompt, "'prompt'", "prompt")}
    return ChatRequest(
        messages=[user],
        system=None if system in (None, "") else validation.text(system, "'system'", "system"),
        raw=user["content"] if raw else None,
        **common,
    )
