"""Issue 62: a log that cannot be written to from outside (service/log_text.py)."""

from __future__ import annotations

import logging
import sys

from service.log_text import OneLineFormatter, printable

FORGED = "/api/chat\n2026-01-01 00:00:00,000 ERROR deskchat.http: FORGED\x1b[2J\r\u2028"


def test_control_characters_are_escaped_and_the_length_bounded():
    text = printable(FORGED, 200)
    assert "\n" not in text and "\r" not in text and "\x1b" not in text and "\u2028" not in text
    assert "\\x0a2026-01-01" in text and "\\x1b[2J" in text and "\\u2028" in text
    assert printable("x" * 500, 100) == "x" * 97 + "..."
    assert printable("é and \U0001f600 stay", 100) == "é and \U0001f600 stay"
    assert printable("\ud800", 10) == "\\ud800"


def test_the_formatter_keeps_a_record_on_one_line_but_a_traceback_on_its_own():
    formatter = OneLineFormatter("%(levelname)s %(name)s: %(message)s")
    record = logging.LogRecord("deskchat.http", logging.INFO, "x", 1, "route=%s", (FORGED,), None)
    assert formatter.format(record).count("\n") == 0
    try:
        raise ValueError("boom")
    except ValueError:
        failed = logging.LogRecord("deskchat", logging.ERROR, "x", 1, "a\nb", (), sys.exc_info())
    lines = formatter.format(failed).splitlines()
    assert lines[0] == "ERROR deskchat: a\\x0ab" and lines[1].startswith("  Traceback")
    assert all(line.startswith("  ") for line in lines[1:])
    try:
        raise ValueError("forged\n2026-01-01 00:00:00,000 ERROR x: y\x1b[2J")
    except ValueError:
        forged = logging.LogRecord("waitress", logging.ERROR, "x", 1, "m", (), sys.exc_info())
    lines = formatter.format(forged).splitlines()
    assert [x for x in lines[1:] if not x.startswith("  ")] == [] and "\x1b" not in lines[-1]
