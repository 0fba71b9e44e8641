"""Prompt-lookup drafts: the tokens that followed the answer's last few tokens earlier on.

Answers to grounded work (summarize this, extract that, fix these typos, rename this
variable) copy long spans of their prompt. When the last n tokens of the answer occurred
before, in the prompt or the answer, the tokens that followed them there are a good guess
for what comes next; the engine runs the guesses as extra rows of the step and keeps the
longest prefix the model itself picks (inference/runtime/engine.py), so a draft never
changes an answer, it only saves steps. Nothing is drafted without a match, so open chat
pays only for the lookups, and a stream whose drafts keep missing drafts less and pauses.
"""

from __future__ import annotations

LONGEST = 4  # n-gram sizes looked up, longest first: a longer match is a better guess
SHORTEST = 2  # one token (", the") matches everywhere in open chat and guesses badly
MOST = 8  # tokens drafted at once at most: past this a miss wastes more than a hit saves
FIRST = 4  # a stream's first draft length, before it has shown how well it copies
MAX_PAUSE = 16  # steps without drafting after misses, at most (doubles with each miss)


class PromptLookup:
    """One stream's token history (prompt, then answer) with an index from every n-gram in it
    to where it last ended, and how many tokens to draft next."""

    def __init__(self, prompt_ids: list[int]):
        self.history: list[int] = []
        self._next: dict[tuple[int, ...], int] = {}  # n-gram -> position after it, latest
        self.limit = FIRST
        self._pause = 0  # steps left without drafting
        self._backoff = 0  # the pause after the next miss
        self.extend(prompt_ids)

    def extend(self, tokens: list[int]) -> None:
        """Append tokens, indexing the n-grams that end just before each."""
        history, index = self.history, self._next
        for token in tokens:
            end = len(history)
            for n in range(SHORTEST, LONGEST + 1):
                if end >= n:
                    index[tuple(history[end - n : end])] = end
            history.append(token)

    def draft(self, most: int) -> list[int]:
        """Up to min(most, the stream's limit) tokens that followed the longest recent
        n-gram the history ends with, earlier on; [] without a match or while paused."""
        if self._pause > 0:
            self._pause -= 1
            return []
        most = min(most, self.limit)
        history = self.history
        for n in range(LONGEST, SHORTEST - 1, -1):
            if len(history) <= n:
                continue
            start = self._next.get(tuple(history[-n:]))
            if start is not None:
                return history[start : start + most]
        return []

    def verified(self, drafted: int, accepted: int) -> None:
        """Adapt to the outcome: all taken, draft twice as many; some, draft one more than
        were taken; none, pause drafting for a while that doubles with each miss in a row."""
        if drafted == 0:
            return
        if accepted == drafted:
            self.limit = min(MOST, 2 * self.limit)
        else:
            self.limit = max(1, accepted + 1)
        if accepted == 0:
            self._backoff = min(MAX_PAUSE, 2 * self._backoff or 1)
            self._pause = self._backoff
        else:
            self._backoff = 0
