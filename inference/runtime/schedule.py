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
step without them (PromptChunks, below). Otherwise the chunking must be the same every time.

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
PREFILL_BESIDE = 32  # prompt rows beside decoding streams until PromptChunks has measured
PREFILL_BLOCK = 32  # fixed chunks with prefix_cache on Linears that are not batch-invariant

SLOWER = 2.0  # a step carrying a prompt chunk takes at most about this times one without
# A new prompt with at most this many rows to compute comes whole in a step beside answering
# streams (one such prompt a step): a new user's question costs the others one longer gap.
SHORT_REST = 64
MOST_BESIDE = 64  # prompt rows beside answering streams at most
NEW_WEIGHT = 0.25  # of a new measurement in PromptChunks' running estimates

LONGEST = 4  # n-gram sizes looked up, longest first: a longer match is a better guess
SHORTEST = 2  # one token (", the") matches everywhere in open chat and guesses badly
MOST = 8  # tokens drafted at once at most: past this a miss wastes more than a hit saves
# A stream's first draft length, before it has shown how well it copies: one token, so a
# first guess that misses (most of open chat's) makes a step of 2 rows, not 5, which was the
# quiet stream's slowest gap (issue 39); a stream that copies doubles it each step (1, 2, 4, 8).
FIRST = 1
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
        """Append tokens, indexing the n-grams that end just before each: for each n, one
        dict update from n shifted slices (a 595-token prompt: 0.18 ms, not 0.6 ms a token at
        a time), later positions overwriting earlier ones as they come."""
        history = self.history
        start = len(history)
        history.extend(tokens)
        last = len(history) - 1  # the n-grams end before positions start .. last
        for n in range(SHORTEST, LONGEST + 1):
            first = max(start, n)
            if first <= last:
                grams = zip(
                    *(history[first - n + i : last - n + i + 1] for i in range(n)), strict=True
                )
                self._next.update(zip(grams, range(first, last + 1), strict=True))

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
    `alone_rows` rows, or `beside_rows` while some stream is decoding (PromptChunks measures
    it); each chunk counts whole `block`s. Beside decoding streams the first new prompt with
    at most SHORT_REST rows to compute comes whole: a short question waits one step, not
    many (estimated: the measured chunk would be about 7 rows on the 1.5B shape beside one
    answer, so three users' 45-token questions arriving together take some 19 steps; measured:
    four users at once got
    19.0-20.5 tok/s in all without this rule, 21.6-21.9 with it, in `--versus-server` runs of
    the same hour). A long prompt's chunks keep to the measured size to its end. A stream
    whose draft raises (its grammar's) ends alone, unscheduled."""
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
    beside = bool(plan.segments)
    room = beside_rows if beside else alone_rows
    whole = beside  # beside answering streams, one short new prompt a step comes at once
    for stream in active:
        if stream.prefilling and room > 0:
            rest = len(stream.prompt_ids) - stream.prefilled
            short = whole and rest <= SHORT_REST and stream.prefilled == stream.reused
            chunk = stream.next_chunk(rest if short else room)
            whole = whole and not short
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
    split = getattr(stream, "split", None)
    in_thought = split is not None and (split.thinking or split.must_open)
    if stream.constraint is not None and not in_thought:  # a thought is free of it
        forced = stream.constraint.forced()[:room]
        if forced:
            return forced
        guess = stream.lookup.draft(room)
        return guess[: stream.constraint.valid_prefix(guess)]
    return stream.lookup.draft(room)


class PromptChunks:
    """How many prompt rows a step carries beside answering streams: running estimates of
    a step's cost without prompt rows and of a prompt row's cost, and the chunk they allow.

    A long prompt arriving while others answer is prefilled in chunks, one per step, and every
    answering stream's next token waits for that step. A fixed chunk (32 rows) made such a
    step take 3-5x a step without one on the Qwen2.5-0.5B shape (a decode step of three
    streams reads the weights once in ~40 ms; each prompt row adds several ms of products and
    attention), so the streams' gaps spread that much while the prompt ran. Instead the
    chunk is sized so that a step with it takes about SLOWER times a step without: both costs
    are measured as steps run (the seconds of steps without prompt rows, the seconds per
    prompt row), so the rule holds on a faster PC, a bigger model and a busy one alike. The
    prompt pays: it gets fewer rows a step (its own first token comes later), which is what a
    person reading a stream notices least.

    On the native step any chunking gives the same bits (a row depends on its position alone);
    on torch's per-row int8 a chunk must keep to the engine's block, so chunks are multiples of
    `align`, at least one.
    """

    def __init__(self, align: int):
        self.align = align
        self.decode_s: float | None = None  # a step with answering rows only
        self.row_s: float | None = None  # one prompt row's share of a step

    def observe(self, decode_rows: int, prompt_rows: int, seconds: float) -> None:
        """One forward's rows and time. A step without prompt rows teaches the decode cost;
        one with them the prompt rows' cost, less the decode rows' share when there are."""
        if prompt_rows == 0:
            self.decode_s = _blend(self.decode_s, seconds)
        elif decode_rows == 0:
            self.row_s = _blend(self.row_s, seconds / prompt_rows)
        elif self.decode_s is not None:
            self.row_s = _blend(self.row_s, max(seconds - self.decode_s, 0.0) / prompt_rows)

    def step_s(self, prompt_rows: int) -> float | None:
        """Expected seconds of a step carrying `prompt_rows` prompt rows (the answering
        streams' cost plus each row's); None until both have been measured."""
        if self.decode_s is None or self.row_s is None:
            return None
        return self.decode_s + prompt_rows * self.row_s

    def beside(self) -> int:
        """Prompt rows for the next step that has answering streams in it."""
        if self.decode_s is None or not self.row_s:
            return PREFILL_BESIDE  # before anything is measured
        rows = int((SLOWER - 1) * self.decode_s / self.row_s)
        rows = rows // self.align * self.align
        return max(self.align, min(MOST_BESIDE // self.align * self.align, rows))


def _blend(old: float | None, new: float) -> float:
    return new if old is None else old + NEW_WEIGHT * (new - old)
