"""Log lines that nothing from outside can split, forge or colour: what a request sent (its
path, a field's name) is written with control characters escaped and its length bounded, and
the server's formatter escapes every message once more, so that one log record is one line.
"""

from __future__ import annotations

import logging
import re

# C0 and C1 controls, DEL, the Unicode line and paragraph separators, lone surrogates.
_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\ud800-\udfff]")


def _escape(match: re.Match) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def printable(text: str, limit: int | None = 200) -> str:
    """`text` with every control character written as an escape (a newline as \\x0a, ESC
    as \\x1b), cut to `limit` characters (None: no limit) with "..." where cut."""
    if limit is not None and len(text) > limit:
        text = text[: limit - 3] + "..."
    return _UNPRINTABLE.sub(_escape, text)


class OneLineFormatter(logging.Formatter):
    """logging's formatter, with the message escaped by printable(): a value some code logs
    without escaping still cannot start a line of its own. A traceback (a library's: the
    server's own errors log only a fault's class and place) keeps its lines, each indented
    and escaped, so that none of them passes for a log line either."""

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 (logging's name)
        record.message = printable(record.message, None)
        return super().formatMessage(record)

    def formatException(self, ei) -> str:  # noqa: N802 (logging's name)
        return _indented(super().formatException(ei))

    def formatStack(self, stack_info: str) -> str:  # noqa: N802 (logging's name)
        return _indented(super().formatStack(stack_info))


def _indented(text: str) -> str:
    return "\n".join("  " + printable(line, None) for line in text.split("\n"))
