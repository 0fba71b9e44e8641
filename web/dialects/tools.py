"""Checking what a request says about tools, for both dialects: a function's definition, the
tool choice, a call in the history, a tool's result. Each dialect reads its own field
shapes and calls these; each check raises InvalidRequest naming the field. The call format
itself is inference/runtime/tools.py.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Set

from inference.runtime.tools import Function, ToolUse
from service.errors import InvalidRequest
from web import checked_json
from web.checked_json import shown
from web.dialects import validation

MAX_TOOLS = 32
MAX_DESCRIPTION_CHARS = 4096
MAX_CALL_ID_CHARS = 64
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
CHOICES = ("none", "auto", "required")


def name(value, where: str, param: str) -> str:
    if not isinstance(value, str) or not NAME.fullmatch(value):
        raise InvalidRequest(
            f"{where} must be a function name of 1-64 letters, digits, '_' or '-'", param=param
        )
    return value


def function(raw: dict, where: str) -> Function:
    """One function: a name, an optional description, optional `parameters` (a JSON schema
    for an object; none means no arguments). Errors name the field, e.g. `tools[1].name`."""
    description = raw.get("description")
    if description is not None and (
        not isinstance(description, str) or len(description) > MAX_DESCRIPTION_CHARS
    ):
        raise InvalidRequest(
            f"{where}.description must be a string of at most {MAX_DESCRIPTION_CHARS} characters",
            param=f"{where}.description",
        )
    parameters = raw.get("parameters")
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
        raise InvalidRequest(
            f"{where}.parameters must be a JSON schema of an object (the call's arguments)",
            param=f"{where}.parameters",
        )
    function_name = name(raw.get("name"), f"{where}.name", f"{where}.name")
    return Function(function_name, description, parameters, f"{where}.parameters")


def typed_function(entry, i: int) -> Function:
    """One of `tools` as OpenAI and Ollama write it: {"type": "function", "function":
    {"name", "description", "parameters", "strict"}} (`strict` may be anything: the schema
    is always enforced)."""
    where = f"tools[{i}]"
    inner = entry.get("function") if isinstance(entry, dict) else None
    if (
        not isinstance(inner, dict)
        or set(entry) != {"type", "function"}
        or entry["type"] != "function"
    ):
        raise InvalidRequest(
            f'{where} must be {{"type": "function", "function": {{"name", ...}}}}', param=where
        )
    unknown = sorted(set(inner) - {"name", "description", "parameters", "strict"})
    if unknown:
        raise InvalidRequest(
            f"{where}.function has an unknown key {shown(unknown[0])}", param=where
        )
    return function(inner, f"{where}.function")


def function_list(raw, read_one) -> tuple[Function, ...]:
    """`tools`: a list of at most MAX_TOOLS entries, each read by `read_one(entry, i)`, with
    no name twice."""
    if not isinstance(raw, list) or len(raw) > MAX_TOOLS:
        raise InvalidRequest(f"'tools' must be a list of at most {MAX_TOOLS} tools", param="tools")
    functions = tuple(read_one(entry, i) for i, entry in enumerate(raw))
    names = [f.name for f in functions]
    for i, n in enumerate(names):
        if n in names[:i]:
            raise InvalidRequest(f"tools[{i}] repeats the name {shown(n)}", param="tools")
    return functions


def tool_use(
    functions: tuple[Function, ...], choice: str | None, parallel, choice_param: str
) -> ToolUse | None:
    """What the answer may do, or None when tools are off: no tools, or choice "none" (then
    the tools are not shown to the model and no call is read from its answer)."""
    if choice is not None and choice not in CHOICES and choice not in {f.name for f in functions}:
        raise InvalidRequest(
            f"'{choice_param}' names {shown(choice)}, which is not one of the tools",
            param=choice_param,
        )
    if parallel is not None and not isinstance(parallel, bool):
        raise InvalidRequest(
            "'parallel_tool_calls' must be true or false", param="parallel_tool_calls"
        )
    if not functions:
        if choice not in (None, "none", "auto"):
            raise InvalidRequest(
                f"'{choice_param}' {shown(choice)} needs 'tools'", param=choice_param
            )
        return None
    if choice == "none":
        return None
    return ToolUse(functions, choice or "auto", parallel is not False)


def typed_calls(
    raw,
    where: str,
    identify: Callable[[object, str, int], str],
    call_keys: Set[str] = frozenset(),
    function_keys: Set[str] = frozenset(),
) -> list[dict]:
    """An assistant's `tool_calls` as OpenAI and Ollama write them, {"id", "type":
    "function", "function": {"name", "arguments"}} each, in the neutral form.
    `identify(given, where, j)`: the j-th call's id from the one it brought (Ollama's may
    bring none); `call_keys`, `function_keys`: what else a call and its function may carry
    (a client's echoes, Ollama's index)."""
    if not isinstance(raw, list) or len(raw) > MAX_TOOLS:
        raise InvalidRequest(
            f"{where}.tool_calls must be a list of at most {MAX_TOOLS} calls", param="messages"
        )
    out = []
    for j, call in enumerate(raw):
        at = f"{where}.tool_calls[{j}]"
        inner = call.get("function") if isinstance(call, dict) else None
        if (
            not isinstance(inner, dict)
            or set(call) - {"id", "type", "function"} - call_keys
            or call.get("type", "function") != "function"
            or set(inner) - {"name", "arguments"} - function_keys
        ):
            raise InvalidRequest(
                f'{at} must be {{"id", "type": "function", "function": {{"name", "arguments"}}}}',
                param="messages",
            )
        out.append(
            {
                "id": identify(call.get("id"), f"{at}.id", j),
                "name": name(inner.get("name"), f"{at}.function.name", "messages"),
                "arguments": arguments(inner.get("arguments"), f"{at}.function.arguments"),
            }
        )
    return out


def call_id(value, where: str) -> str:
    value = validation.text(value, where, "messages")
    if len(value) > MAX_CALL_ID_CHARS:
        raise InvalidRequest(f"{where} is over {MAX_CALL_ID_CHARS} characters", param="messages")
    return value


def arguments(value, where: str) -> dict:
    """A call's arguments: a JSON object, or (OpenAI) a string holding one."""
    if isinstance(value, str):
        value = checked_json.parse(value, where)  # checked as the body was
    if not isinstance(value, dict):
        raise InvalidRequest(f"{where} must hold a JSON object", param="messages")
    return value


def result(value: str, where: str) -> str:
    """A tool's result: text, which may be empty (a tool that found nothing)."""
    if not isinstance(value, str):
        raise InvalidRequest(f"{where} must be a string", param="messages")
    return value if not value.strip() else validation.text(value, where, "messages")


def check_history(messages: list[dict]) -> None:
    """Each tool result answers a call of the assistant turn before it (tool results in
    between): its `tool_call_id` is one of that turn's call ids."""
    open_ids: set[str] = set()
    for i, m in enumerate(messages):
        if m["role"] == "tool":
            if m["tool_call_id"] not in open_ids:
                raise InvalidRequest(
                    f"messages[{i}] is a tool result for {shown(m['tool_call_id'])}, which is not "
                    "a call of the assistant message before it",
                    param="messages",
                )
        else:
            open_ids = {c["id"] for c in m.get("tool_calls", ())}
