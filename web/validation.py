"""Checking a /chat body. The named limits and the one validator that raises 400."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from inference.errors import InvalidRequest

ROLES = ("system", "user", "assistant")
MAX_MESSAGES = 200
MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 64
MAX_TEMPERATURE = 2.0
KNOWN_FIELDS = {
    "message",
    "messages",
    "system",
    "max_tokens",
    "temperature",
    "top_p",
    "stream",
    "stop",
}


@dataclass(frozen=True)
class ChatRequest:
    messages: list[dict]
    system: str | None
    max_tokens: int | None
    temperature: float
    top_p: float
    stream: bool
    stop: tuple[str, ...]


def _is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _valid_unicode(value: str, what: str) -> str:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate such as "\ud800"
        raise InvalidRequest(f"{what} is not valid Unicode text") from None
    return value


def _text(value, what: str) -> str:
    if not isinstance(value, str):
        raise InvalidRequest(f"{what} must be a string")
    if not value.strip():
        raise InvalidRequest(f"{what} is empty")
    return _valid_unicode(value, what)


def _messages(body: dict) -> list[dict]:
    has_one, has_list = "message" in body, "messages" in body
    if has_one == has_list:
        raise InvalidRequest("give exactly one of 'message' (a string) or 'messages' (a list)")
    if has_one:
        return [{"role": "user", "content": _text(body["message"], "'message'")}]
    raw = body["messages"]
    if not isinstance(raw, list) or not raw:
        raise InvalidRequest("'messages' must be a non-empty list")
    if len(raw) > MAX_MESSAGES:
        raise InvalidRequest(f"'messages' has {len(raw)} entries; at most {MAX_MESSAGES}")
    out = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict) or set(m) != {"role", "content"}:
            raise InvalidRequest(f"messages[{i}] must be an object with 'role' and 'content'")
        if m["role"] not in ROLES:
            raise InvalidRequest(f"messages[{i}].role {m['role']!r} is not one of {ROLES}")
        out.append({"role": m["role"], "content": _text(m["content"], f"messages[{i}].content")})
    if out[-1]["role"] != "user":
        raise InvalidRequest("the last message must be the user's")
    return out


def _number(
    body: dict, key: str, default: float, low: float, high: float, low_open: bool = False
) -> float:
    value = body.get(key, default)
    if not _is_number(value) or not math.isfinite(value):
        raise InvalidRequest(f"'{key}' must be a finite number")
    if value > high or value < low or (low_open and value == low):
        bracket = "(" if low_open else "["
        raise InvalidRequest(f"'{key}' must be in {bracket}{low:g}, {high:g}], got {value}")
    return float(value)


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop", [])
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or len(stop) > MAX_STOP_STRINGS:
        raise InvalidRequest(f"'stop' must be a list of at most {MAX_STOP_STRINGS} strings")
    for s in stop:
        if not isinstance(s, str) or not s or len(s) > MAX_STOP_CHARS:
            raise InvalidRequest(
                f"each 'stop' entry must be a string of 1..{MAX_STOP_CHARS} characters"
            )
        _valid_unicode(s, "'stop'")
    return tuple(stop)


def _no_constants(name: str):
    raise ValueError(f"{name} is not a JSON number")


def parse_json(data: bytes):
    """The body as JSON, or InvalidRequest saying why not (NaN, absurd nesting included)."""
    try:
        return json.loads(data, parse_constant=_no_constants)
    except (ValueError, RecursionError) as exc:
        reason = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
        raise InvalidRequest(f"the body is not valid JSON: {reason}"[:300]) from None


def validate_chat_request(body) -> ChatRequest:
    """The whole /chat body, checked; raises InvalidRequest naming the first problem."""
    if not isinstance(body, dict):
        raise InvalidRequest("the body must be a JSON object")
    unknown = sorted(set(body) - KNOWN_FIELDS)
    if unknown:
        raise InvalidRequest(f"unknown field(s): {', '.join(unknown)}")
    system = body.get("system")
    if system is not None:
        system = _text(system, "'system'")
    max_tokens = body.get("max_tokens")
    if max_tokens is not None and (
        not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1
    ):
        raise InvalidRequest("'max_tokens' must be a positive integer")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise InvalidRequest("'stream' must be true or false")
    return ChatRequest(
        messages=_messages(body),
        system=system,
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 0.0, 0.0, MAX_TEMPERATURE),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, low_open=True),
        stream=stream,
        stop=_stop(body),
    )
