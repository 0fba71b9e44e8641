"""Incremental detokenization for streaming: whole characters only, stop strings held back.

Decodes a short window of recent ids per token (the prefix/read-offset scheme of text-
generation-inference), so the cost per token stays flat however long the answer grows.
"""

from __future__ import annotations


class TextAssembler:
    def __init__(self, tokenizer, stop: tuple[str, ...]):
        self._tokenizer = tokenizer
        self._stop = stop
        self._ids: list[int] = []
        self._prefix = 0  # ids[_prefix:_read] are already part of _text; the window's context
        self._read = 0
        self._text = ""  # everything decoded so far
        self._emitted = 0  # characters of _text already handed out
        self.stopped = False

    def add(self, token_id: int) -> str:
        """Returns the text that is now safe to emit (may be empty)."""
        self._ids.append(token_id)
        before = self._decode(self._prefix, self._read)
        after = self._decode(self._prefix, len(self._ids))
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""  # a special token, or half a character: wait for more
        self._text += after[len(before) :]
        self._prefix, self._read = self._read, len(self._ids)
        return self._release()

    def flush(self) -> str:
        """At the end: whatever is left (held-back text, a dangling partial character)."""
        if self.stopped:
            return ""
        before = self._decode(self._prefix, self._read)
        self._text += self._decode(self._prefix, len(self._ids))[len(before) :]
        self._read = len(self._ids)
        return self._take(len(self._text))

    def _decode(self, start: int, end: int) -> str:
        return self._tokenizer.decode(self._ids[start:end], skip_special_tokens=True)

    def _release(self) -> str:
        hits = [i for i in (self._text.find(s, self._emitted) for s in self._stop) if i >= 0]
        if hits:
            self.stopped = True
            return self._take(min(hits))
        return self._take(len(self._text) - self._held_back())

    def _held_back(self) -> int:
        """Length of the longest tail of the text that could still grow into a stop string."""
        tail = self._text[self._emitted :]
        for n in range(min(max(map(len, self._stop), default=1) - 1, len(tail)), 0, -1):
            if any(s.startswith(tail[-n:]) for s in self._stop):
                return n
        return 0

    def _take(self, end: int) -> str:
        piece = self._text[self._emitted : end] if end > self._emitted else ""
        self._emitted = max(self._emitted, end)
        return piece
