"""API keys: the key file, and the constant-time check of a presented key.

The file holds one `name:key` per line (`#` comments and blank lines ignored); the name says
which tool holds the key and is what logs show. Keys are never logged or echoed.
"""

from __future__ import annotations

import hmac
from pathlib import Path

MIN_KEY_CHARS = 16
NAME_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")


class KeyFileError(ValueError):
    """The key file cannot be used; the message names the file and line, never a key."""


def parse_keys(text: str, source: str) -> dict[str, bytes]:
    """name -> key from the file's text; raises KeyFileError for the first bad line."""
    keys: dict[str, bytes] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        where = f"{source}, line {number}"
        name, sep, key = line.partition(":")
        name, key = name.strip(), key.strip()
        if not sep or not name or not key:
            raise KeyFileError(f"{where}: expected 'name:key'")
        if not set(name) <= NAME_CHARS:
            raise KeyFileError(f"{where}: a name may hold only letters, digits and . _ -")
        if not all("!" <= c <= "~" for c in key):
            raise KeyFileError(
                f"{where}: the key for {name!r} must be printable ASCII without spaces "
                "(HTTP headers carry nothing else)"
            )
        if len(key) < MIN_KEY_CHARS:
            raise KeyFileError(
                f"{where}: the key for {name!r} is {len(key)} characters; at least "
                f"{MIN_KEY_CHARS} are needed (make one with: python3 -c 'import secrets; "
                "print(secrets.token_urlsafe(32))')"
            )
        if name in keys:
            raise KeyFileError(f"{where}: the name {name!r} is used twice")
        if any(hmac.compare_digest(key.encode(), other) for other in keys.values()):
            raise KeyFileError(f"{where}: the key for {name!r} is also another name's key")
        keys[name] = key.encode()
    return keys


def read_key_file(path: Path) -> dict[str, bytes]:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise KeyFileError(f"cannot read the API key file {path}: {reason}") from None
    return parse_keys(text, str(path))


class KeyRing:
    """The keys in force. `replace()` swaps in a new dict with one assignment: a request is
    checked against the old set or the new one, never a mix, so no lock is needed."""

    def __init__(self, keys: dict[str, bytes] | None = None):
        self._keys = dict(keys or {})

    def __len__(self) -> int:
        return len(self._keys)

    def replace(self, keys: dict[str, bytes]) -> None:
        self._keys = dict(keys)

    def name_of(self, presented: str) -> str | None:
        """The name whose key this is, or None. Every key is compared, in constant time, so
        the time taken tells nothing about which key came close."""
        candidate = presented.encode("utf-8", "surrogateescape")
        found = None
        for name, key in self._keys.items():
            if hmac.compare_digest(candidate, key) and found is None:
                found = name
        return found
