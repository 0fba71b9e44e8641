"""Checking request bodies: the named limits and the field checks every dialect shares.

Each check raises InvalidRequest naming the field (`param`) and the problem. What a body may
contain is each dialect's own business (dialects/chat_api.py, dialects/openai_request.py); what one
field may hold, and into which ChatRequest it turns, is decided here once.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from inference.runtime.tools import ToolUse
from service.errors import InvalidRequest

MAX_MESSAGES = 200
MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 64
MAX_TEMPERATURE = 2.0
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch's generator takes


@dataclass(frozen=True)
class JsonSchema:
    """An answer constrained to JSON: the schema, and the request field it came in."""

    schema: dict
    param: str


ANY_OBJECT = {"type": "object"}


def json_schema(value, param: str) -> JsonSchema:
    if not isinstance(value, dict):
        raise InvalidRequest(f"'{param}' must hold a JSON schema (an object)", param=param)
    return JsonSchema(value, param)


@dataclass(frozen=True)
class ChatRequest:
    """One chat request in any dialect, checked; the one input of `relay.submit()`."""

    messages: list[dict]
    system: str | None = None
    max_tokens: int | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    stream: bool = False
    stop: tuple[str, ...] = ()
    seed: int | None = None
    json: JsonSchema | None = None  # None: free text
    tools: ToolUse | None = None  # None: no tools shown, no calls read


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _valid_unicode(value: str, what: str, param: str) -> str:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate such as "\ud800"
        raise InvalidRequest(f"{what} is not valid Unicode text", param=param) from None
    return value


def text(value, what: str, param: str) -> str:
    """A non-empty string of valid Unicode."""
    if not isinstance(value, str):
        raise InvalidRequest(f"{what} must be a string", param=param)
    if not value.strip():
        raise InvalidRequest(f"{what} is empty", param=param)
    return _valid_unicode(value, what, param)


def check_turns(messages: list[dict]) -> list[dict]:
    """The conversation must end with the user's turn, or with tool results: that is what
    the model answers."""
    if messages[-1]["role"] not in ("user", "tool"):
        raise InvalidRequest(
            "the last message must be the user's (or a tool's result)", param="messages"
        )
    return messages


def message_list(raw) -> list:
    if not isinstance(raw, list) or not raw:
        raise InvalidRequest("'messages' must be a non-empty list", param="messages")
    if len(raw) > MAX_MESSAGES:
        raise InvalidRequest(
            f"'messages' has {len(raw)} entries; at most {MAX_MESSAGES}", param="messages"
        )
    return raw


def number(
    body: dict, key: str, default: float, low: float, high: float, low_open: bool = False
) -> float:
    """A finite number in [low, high] (or (low, high]); any JSON number, however large."""
    value = body.get(key, default)
    if value is None:
        value = default
    try:
        as_float = float(value) if isinstance(value, int | float) else math.nan
    except OverflowError:  # an integer with hundreds of digits
        as_float = math.inf
    if isinstance(value, bool) or not math.isfinite(as_float):
        raise InvalidRequest(f"'{key}' must be a finite number", param=key)
    if as_float > high or as_float < low or (low_open and as_float == low):
        bracket = "(" if low_open else "["
        shown = f"{as_float:g}"
        raise InvalidRequest(
            f"'{key}' must be in {bracket}{low:g}, {high:g}], got {shown}", param=key
        )
    return as_float


def temperature(body: dict) -> float:
    return number(body, "temperature", 0.0, 0.0, MAX_TEMPERATURE)


def top_p(body: dict) -> float:
    return number(body, "top_p", 1.0, 0.0, 1.0, low_open=True)


def positive_int(value, key: str) -> int | None:
    """None when absent, else an integer of at least 1."""
    if value is None:
        return None
    if not is_int(value) or value < 1:
        raise InvalidRequest(f"'{key}' must be a positive integer", param=key)
    return value


def seed(value) -> int | None:
    if value is None:
        return None
    if not is_int(value) or not SEED_RANGE[0] <= value <= SEED_RANGE[1]:
        raise InvalidRequest("'seed' must be an integer of at most 64 bits", param="seed")
    return value


def flag(body: dict, key: str) -> bool:
    value = body.get(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise InvalidRequest(f"'{key}' must be true or false", param=key)
    return value


def stop(body: dict) -> tuple[str, ...]:
    """`stop`: a string or a list of at most MAX_STOP_STRINGS short strings."""
    value = body.get("stop")
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or len(value) > MAX_STOP_STRINGS:
        raise InvalidRequest(
            f"'stop' must be a list of at most {MAX_STOP_STRINGS} strings", param="stop"
        )
    for s in value:
        if not isinstance(s, str) or not s or len(s) > MAX_STOP_CHARS:
            raise InvalidRequest(
                f"each 'stop' entry must be a string of 1..{MAX_STOP_CHARS} characters",
                param="stop",
            )
        _valid_unicode(s, "'stop'", "stop")
    return tuple(value)


def known_fields(body, allowed: set[str]) -> dict:
    """The body as a dict with no field outside `allowed`: a typo never passes silently."""
    if not isinstance(body, dict):
        raise InvalidRequest("the body must be a JSON object")
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise InvalidRequest(f"unknown field(s): {', '.join(unknown)}", param=unknown[0])
    return body


def _no_constants(name: str):
    raise ValueError(f"{name} is not a JSON number")


def parse_json(data: bytes):
    """The body as JSON, or InvalidRequest saying why not (NaN, absurd nesting included)."""
    try:
        return json.loads(data, parse_constant=_no_constants)
    except (ValueError, RecursionError) as exc:
        reason = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
        raise InvalidRequest(f"the body is not valid JSON: {reason}"[:300]) from None
