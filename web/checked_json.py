"""Every JSON deskchat reads from a request, checked once, before anything else reads it: the
body, and any JSON held in one of its strings (a call's arguments sent as text).

The body must be UTF-8 (RFC 8259 for JSON between systems; a UTF-8 byte-order mark is
allowed). The parsed value is walked once: every string and every key must be Unicode text
that encodes as UTF-8 (a lone surrogate, escaped as "\\ud800" or sent as raw bytes, is not),
and objects and lists nest at most MAX_DEPTH levels. After that no stage (the tokenizer, the
grammar, json.dumps, the log) meets a lone surrogate or a nesting that overflows the stack.
A refusal is a 400 naming, in its message and its `param`, the path of the first bad value
in document order (`tools[0].function.parameters.properties`), with at most
MAX_SHOWN_CHARS of the value as sent. Nothing else in the server checks Unicode or depth.
"""

from __future__ import annotations

import json
import re

from service.errors import InvalidRequest

# How deep objects and lists may nest, the body's own braces counted: a JSON schema of its
# own 32 levels (inference/runtime/grammar.py's MAX_SCHEMA_DEPTH) inside a tool definition
# is about 37. Far below the stack's limit for the json module and for the walks after it.
MAX_DEPTH = 64
MAX_SHOWN_CHARS = 120  # of a value quoted in an error
MAX_PATH_CHARS = 120  # of a field's path named in an error
MAX_KEY_CHARS = 40  # of one key within that path
_PLAIN_KEY = re.compile(r"[A-Za-z_$][A-Za-z0-9_$-]*")


def shown(value) -> str:
    """A request's value for an error message: as JSON with non-ASCII escaped (so a lone
    surrogate or a control character is visible, not sent raw), at most MAX_SHOWN_CHARS."""
    if not isinstance(value, str | int | float | bool | None):
        value = _clip_nesting(value)
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):  # a float such as inf; anything odd
        text = repr(value)
    return _clip(text, MAX_SHOWN_CHARS)


def parse_body(data: bytes):
    """The request body as JSON, checked (see the module's docstring), or InvalidRequest."""
    encoding = json.detect_encoding(data)
    if encoding not in ("utf-8", "utf-8-sig"):
        raise InvalidRequest(
            f"the body must be JSON in UTF-8; this one reads as {encoding.upper()}"
        )
    # Bytes that are not UTF-8 become lone surrogates here, and the walk refuses them naming
    # where they are; valid UTF-8 decodes exactly as a strict decode would.
    return parse(data.decode(encoding, "surrogateescape"), "")


def parse(text: str, path: str):
    """JSON held in `text` (the body when `path` is empty, else the field at `path`),
    checked as the body is, or InvalidRequest naming the field."""
    try:
        value = json.loads(text, parse_constant=_no_constants)
    except (ValueError, RecursionError) as exc:
        reason = "it nests too deeply" if isinstance(exc, RecursionError) else str(exc)
        where = f"'{_clip(path, MAX_PATH_CHARS)}'" if path else "the body"
        raise InvalidRequest(
            _clip(f"{where} is not valid JSON: {reason}", 300), param=_param(path)
        ) from None
    check(value, path)
    return value


def check(value, path: str = "") -> None:
    """Walk `value` (found at `path`) once, iteratively: InvalidRequest for the first string
    or key that is not Unicode text, or the first object or list past MAX_DEPTH. A value's
    place is a link to its parent's: the path is spelled out only for a refusal (built for
    every value, the paths of a deep body cost memory in proportion to its depth times its
    width)."""
    stack: list[tuple[object, int, tuple | None]] = [(value, 1, None)]
    while stack:
        item, depth, place = stack.pop()
        if isinstance(item, str):
            if not _encodes(item):
                problem = "is not valid Unicode text (a lone surrogate, or bytes that are not "
                raise _refusal(_spelled(path, place), f"{problem}UTF-8): {shown(item)}")
            continue
        if not isinstance(item, dict | list):
            continue
        if depth > MAX_DEPTH:
            problem = f"nests deeper than {MAX_DEPTH} levels of objects and lists"
            raise _refusal(_spelled(path, place), problem)
        if isinstance(item, list):
            children = [(child, depth + 1, (place, i)) for i, child in enumerate(item)]
        else:
            for key in item:
                if not _encodes(key):
                    problem = f"holds a name that is not valid Unicode text: {shown(key)}"
                    raise _refusal(_spelled(path, place), problem)
            children = [(child, depth + 1, (place, key)) for key, child in item.items()]
        stack.extend(reversed(children))


def _spelled(path: str, place: tuple | None) -> str:
    """The path of a place (a chain of (parent's place, key or index) links) below `path`."""
    steps = []
    while place is not None:
        place, step = place
        steps.append(step)
    for step in reversed(steps):
        path = f"{path}[{step}]" if isinstance(step, int) else _join(path, step)
    return path


def model_json(text: str):
    """JSON the model wrote (a call's arguments, held to a schema by the grammar), parsed.
    The grammar lets a string hold an escape such as "\\ud800" (valid JSON, no text): such a
    lone surrogate becomes "?", so that every answer can be written out as UTF-8."""
    return _mended(json.loads(text))


def _mended(value):
    if isinstance(value, str):
        return value if _encodes(value) else value.encode("utf-8", "replace").decode("utf-8")
    if isinstance(value, list):
        return [_mended(v) for v in value]
    if isinstance(value, dict):
        return {_mended(k): _mended(v) for k, v in value.items()}
    return value


def _refusal(path: str, problem: str) -> InvalidRequest:
    where = f"'{_clip(path, MAX_PATH_CHARS)}'" if path else "the body"
    return InvalidRequest(f"{where} {problem}", param=_param(path))


def _param(path: str) -> str | None:
    return _clip(path, MAX_PATH_CHARS) if path else None


def _join(path: str, key: str) -> str:
    """`path.key`, or `path["odd key"]` for a key that is not a plain name (quoted as JSON,
    so no control character or lone surrogate reaches a message or the log)."""
    if _PLAIN_KEY.fullmatch(key) and len(key) <= MAX_KEY_CHARS:
        return f"{path}.{key}" if path else key
    return f"{path}[{_clip(json.dumps(key), MAX_KEY_CHARS)}]"


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _clip_nesting(value, levels: int = 3):
    """A copy of `value` at most `levels` deep and a few items wide: enough to show."""
    if levels == 0:
        return "..."
    if isinstance(value, list):
        return [_clip_nesting(v, levels - 1) for v in value[:4]]
    if isinstance(value, dict):
        return {str(k): _clip_nesting(v, levels - 1) for k, v in list(value.items())[:4]}
    return value


def _encodes(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _no_constants(name: str):
    raise ValueError(f"{name} is not a JSON number")
