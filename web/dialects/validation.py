"""Checking request bodies: the named limits and the field checks every dialect shares.

Each check raises InvalidRequest naming the field (`param`) and the problem. What a body may
contain is each dialect's own business (dialects/chat_api.py, dialects/openai_request.py); what one
field may hold, and into which ChatRequest it turns, is decided here once.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from inference.runtime.jobs import SAMPLING_RANGES
from inference.runtime.tools import ToolUse
from service.errors import InvalidRequest

MAX_MESSAGES = 200
MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 64
MAX_MODEL_CHARS = 256
MAX_NAMED = 5  # unknown fields named in an error, each cut at MAX_FIELD_NAME_CHARS
MAX_FIELD_NAME_CHARS = 40
# The fields every dialect reads with `sampling()`, under the same names.
SAMPLING_FIELDS = {"temperature", "top_p", "top_k", "min_p", "repetition_penalty"}
SAMPLING_FIELDS |= {"frequency_penalty", "presence_penalty", "seed", "logprobs", "top_logprobs"}
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


def json_format(value, param: str = "format") -> JsonSchema | None:
    """Ollama's `format` (which /chat took over): "json" for any JSON object, or a JSON
    schema the answer must follow."""
    if value is None:
        return None
    if value == "json":
        return JsonSchema(ANY_OBJECT, param)
    return json_schema(value, param)


@dataclass(frozen=True)
class ChatRequest:
    """One chat request in any dialect, checked; the one input of `relay.submit()`."""

    messages: list[dict]
    system: str | None = None
    max_tokens: int | None = None
    # None: the served defaults (SamplingDefaults: the model's generation_config.json)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logprobs: bool = False
    top_logprobs: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, amount) in id order
    stream: bool = False
    stop: tuple[str, ...] = ()
    seed: int | None = None
    json: JsonSchema | None = None  # None: free text
    tools: ToolUse | None = None  # None: no tools shown, no calls read
    # A prompt as the model reads it, template and all (Ollama's `raw`): then `messages` is
    # only its record and `system` is None.
    raw: str | None = None
    think: bool | None = None  # a thinking model's switch (Qwen3's); None: --thinking
    # The field that asked for a thought, named when the model does not think; None: a hint
    # that such a model ignores (reasoning_effort).
    think_param: str | None = "think"


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def text(value, what: str, param: str) -> str:
    """A non-empty string (valid Unicode: web/checked_json.py checked every string)."""
    if not isinstance(value, str):
        raise InvalidRequest(f"{what} must be a string", param=param)
    if not value.strip():
        raise InvalidRequest(f"{what} is empty", param=param)
    return value


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


def number(body: dict, key: str, default: float | None, name: str = "") -> float | None:
    """A finite number in the key's SAMPLING_RANGES; any JSON number, however large. Left
    out or null: `default`. `name`: what the dialect calls the field, if not `key`."""
    value = body.get(key)
    name = name or key
    if value is None:
        return default
    try:
        as_float = float(value) if isinstance(value, int | float) else math.nan
    except OverflowError:  # an integer with hundreds of digits
        as_float = math.inf
    if isinstance(value, bool) or not math.isfinite(as_float):
        raise InvalidRequest(f"'{name}' must be a finite number", param=name)
    allowed = SAMPLING_RANGES[key]
    if not allowed.holds(as_float):
        shown = repr(value) if isinstance(value, float) else str(value)  # as sent
        shown = shown if len(shown) <= 40 else shown[:37] + "..."
        raise InvalidRequest(f"'{name}' must be {allowed}, got {shown}", param=name)
    return as_float


def integer(value, key: str, name: str = "") -> int | None:
    """None when left out, else an integer in the key's SAMPLING_RANGES."""
    if value is None:
        return None
    allowed, name = SAMPLING_RANGES[key], name or key
    if not is_int(value) or not allowed.holds(value):
        off = " (0 or -1: off)" if key == "top_k" else ""
        raise InvalidRequest(f"'{name}' must be {allowed}{off}", param=name)
    return value


def sampling(body: dict, names: Mapping[str, str] = MappingProxyType({})) -> dict:
    """The SAMPLING_FIELDS of a body, checked, as ChatRequest's keyword arguments. What is
    left out of temperature, top_p, top_k, min_p and repetition_penalty stays None: the
    served defaults fill it in (web/relay.py). `names`: what the dialect calls a field where
    it differs, for the errors (Ollama's `options.repeat_penalty`)."""
    asked_logprobs = flag(body, "logprobs")
    alternatives = integer(body.get("top_logprobs"), "top_logprobs") or 0
    if alternatives and not asked_logprobs:
        raise InvalidRequest("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    top_k = integer(body.get("top_k"), "top_k", names.get("top_k", ""))

    def real(key: str, default: float | None) -> float | None:
        return number(body, key, default, names.get(key, ""))

    return {
        "temperature": real("temperature", None),
        "top_p": real("top_p", None),
        "top_k": None if top_k is None else max(top_k, 0),  # 0 and -1: off
        "min_p": real("min_p", None),
        "repetition_penalty": real("repetition_penalty", None),
        "frequency_penalty": real("frequency_penalty", 0.0),
        "presence_penalty": real("presence_penalty", 0.0),
        "seed": seed(body.get("seed"), names.get("seed", "seed")),
        "logprobs": asked_logprobs,
        "top_logprobs": alternatives,
    }


def positive_int(value, key: str) -> int | None:
    """None when absent, else an integer of at least 1."""
    if value is None:
        return None
    if not is_int(value) or value < 1:
        raise InvalidRequest(f"'{key}' must be a positive integer", param=key)
    return value


def seed(value, name: str = "seed") -> int | None:
    if value is None:
        return None
    if not is_int(value) or not SEED_RANGE[0] <= value <= SEED_RANGE[1]:
        raise InvalidRequest(f"'{name}' must be an integer of at most 64 bits", param=name)
    return value


def flag(body: dict, key: str) -> bool:
    value = body.get(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise InvalidRequest(f"'{key}' must be true or false", param=key)
    return value


def stop(body: dict, name: str = "stop") -> tuple[str, ...]:
    """`stop`: a string or a list of at most MAX_STOP_STRINGS short strings. `name`: what
    the dialect calls the field."""
    value = body.get("stop")
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or len(value) > MAX_STOP_STRINGS:
        raise InvalidRequest(
            f"'{name}' must be a list of at most {MAX_STOP_STRINGS} strings", param=name
        )
    for s in value:
        if not isinstance(s, str) or not s or len(s) > MAX_STOP_CHARS:
            raise InvalidRequest(
                f"each '{name}' entry must be a string of 1..{MAX_STOP_CHARS} characters",
                param=name,
            )
    return tuple(value)


def think(value, name: str) -> bool | None:
    """A thinking switch: true, false, or left out (None: the server's --thinking)."""
    if value is not None and not isinstance(value, bool):
        raise InvalidRequest(f"'{name}' must be true or false", param=name)
    return value


def reasoning(value, where: str) -> str:
    """An earlier assistant turn's thought, sent back: text, which may be empty."""
    if not isinstance(value, str):
        raise InvalidRequest(f"{where} must be a string", param="messages")
    return value


def _same(a, b) -> bool:
    """Equal as JSON values: 0 == 0.0 but False != 0."""
    return a == b and isinstance(a, bool) == isinstance(b, bool)


def check_no_op(key: str, value, allowed: tuple | None) -> None:
    """A field we take no action on may hold only the values under which that is exactly
    what the dialect's own server does (`allowed`; None: any string)."""
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


def model(body: dict) -> None:
    """`model` may name anything (one model is served, and every answer names it), but it
    is a short string."""
    value = body.get("model")
    if value is not None and (not isinstance(value, str) or len(value) > MAX_MODEL_CHARS):
        raise InvalidRequest(
            f"'model' must be a string of at most {MAX_MODEL_CHARS} characters", param="model"
        )


def known_fields(body, allowed: set[str]) -> dict:
    """The body as a dict with no field outside `allowed`: a typo never passes silently."""
    if not isinstance(body, dict):
        raise InvalidRequest("the body must be a JSON object")
    unknown = sorted(set(body) - allowed)
    if unknown:
        names = ", ".join(_clip(name, MAX_FIELD_NAME_CHARS) for name in unknown[:MAX_NAMED])
        more = f" and {len(unknown) - MAX_NAMED} more" if len(unknown) > MAX_NAMED else ""
        raise InvalidRequest(
            f"unknown field(s): {names}{more}", param=_clip(unknown[0], MAX_FIELD_NAME_CHARS)
        )
    return body


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."
