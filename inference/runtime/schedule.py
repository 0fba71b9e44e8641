"""Which rows run this step, the first of a step's three parts (engine.step: schedule ->
run -> accept).

A step is one forward over every open stream: one row for each decoding stream's last
token, with the tokens drafted for it after it, then prompt chunks of the prefilling
streams, in order, so a long prompt arriving costs the running streams a little per step
instead of freezing them.

Prompts are prefilled in chunks, so a cancel or deadline is noticed between chunks. With
torch's per-row int8 (batch-invariant) any chunking on 16-token boundaries gives bitwise the
same keys, values and logits (checked on SmolLM2 with 16, 32 and 64; 7 and 1 differ); on the
native step any chunking does (a row depends on its position alone), so a chunk may end
anywhere there. The chunk size may follow the load: big alone, beside decoding streams,
whose next token waits for the step, as many rows as keep the step within about twice a
step without them (chunking.py). Otherwise the chunking must be the same every time.

Drafts (with `speculate`) are prompt-lookup guesses: the tokens that followed the answer's
last few tokens earlier on. Answers to grounded work (summarize this, extract that, fix
these typos, rename this variable) copy long spans of their prompt. When the last n tokens
of the answer occurred before, in the prompt or the answer, the tokens that followed them
there are a good guess for what comes next; they run as extra rows of the step and the
accepting part keeps the longest prefix the model itself picks (inference/runtime/accept.py),
so a draft never changes an answer, it only saves steps. Nothing is drafted without a match,
so open chat pays only for the lookups, and a stream whose drafts keep missing drafts less
and pauses. Under a JSON grammar the tokens it forces are drafted first (jump-forward).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from inference.model.decoder import Segment

ALIGN = 16
PREFILL_CHUNK = 256  # rows per forward when no other stream is decoding
PREFILL_BESIDE = 32  # prompt rows per step while others decode, until measured (chunking.py)
PREFILL_BLOCK = 32  # fixed chunks with prefix_cache on Linears that are not batch-invariant

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


@dataclass
class Plan:
    """One step's rows: the streams fed and, in the same order, each one's segment."""

    streams: list = field(default_factory=list)
    segments: list[Segment] = field(default_factory=list)

    def add(self, stream, segment: Segment) -> None:
        self.streams.append(stream)
        self.segments.append(segment)


def schedule(streams: list, alone_rows: int, block: int, beside_rows: int = PREFILL_BESIDE) -> Plan:
    """The rows of the next forward: a token for every decoding stream (with the tokens
    drafted for it, if any), and prompt chunks of the first prefilling ones, in order, up to
    `alone_rows` rows, or `beside_rows` while some stream is decoding (chunking.py measures
    it); each chunk counts whole `block`s. A stream whose draft raises (its grammar's) ends
    alone, unscheduled."""
    plan = Plan()
    active = [s for s in streams if s.finish is None]
    for stream in active:
        if not stream.prefilling:
            try:
                tokens = draft(stream)
            except Exception as exc:  # its grammar's: that stream alone ends
                stream.fail(exc)
                continue
            plan.add(stream, Segment(stream.cache, [stream.token, *tokens], decoding=True))
    room = beside_rows if plan.segments else alone_rows
    for stream in active:
        if stream.prefilling and room > 0:
            chunk = stream.next_chunk(room)
            room -= -(-len(chunk) // block) * block
            plan.add(stream, Segment(stream.cache, chunk))
    return plan


def draft(stream) -> list[int]:
    """The tokens to check after the stream's next input: none without speculation or
    room; under a grammar, the tokens it forces (jump-forward), else a prompt lookup's
    guess cut where the grammar would refuse it."""
    room = stream.budget - stream.completion_tokens  # the cache holds prompt + budget
    if stream.lookup is None or room <= 0:
        return []
    if stream.constraint is not None:
        forced = stream.constraint.forced()[:room]
        if forced:
            return forced
        guess = stream.lookup.draft(room)
        return guess[: stream.constraint.valid_prefix(guess)]
    return stream.lookup.draft(room)
