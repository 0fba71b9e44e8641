"""Accepting a step's tokens, the last of a step's three parts (engine.step: schedule ->
run -> accept).

For each stream the forward gave rows to: a prefilling stream counts the prompt it read and,
at its prompt's end, picks its first token; a decoding stream picks a token from each row in
turn while the picks agree with its draft. Each pick is the per-token pipeline: penalties
and the grammar's mask change the logits, the sampler picks (inference/runtime/sampler.py),
logprobs are taken, the token is detokenized, and stop strings, the grammar's end, an
end-of-generation token or the budget may end the stream.

Detokenizing for streaming gives whole characters only, stop strings held back: a short
window of recent ids is decoded per token (the prefix/read-offset scheme of text-
generation-inference), so the cost per token stays flat however long the answer grows.

A thinking model's thought (Qwen3 writes it between the tokens `<think>` and `</think>`) is
kept apart from its answer by a ThoughtSplit (below): which tokens are thought, their text,
and when the server closes a thought itself so that the answer still gets its room within
the budget. The grammar, the stop strings and the logprobs are the answer's only; the
newlines the template puts around a thought (`<think>\n...\n</think>\n\n`) are in neither.
"""

from __future__ import annotations

import time

import torch

from inference.runtime import sampler
from inference.runtime.budget import thought_limit
from inference.runtime.jobs import TokenLogprob


def accept(plan, logits: torch.Tensor, eos_ids: set[int], pieces: TokenPieces) -> tuple[int, int]:
    """Each scheduled stream's tokens from its rows of `logits` (inference/runtime/schedule.py's
    Plan, in its order): (tokens drafted, of them taken) over all streams. What one stream's
    own token choice raises (sampling, grammar, detokenizing) ends that stream alone
    (`Stream.error`)."""
    row = drafted = accepted = 0
    for stream, segment in zip(plan.streams, plan.segments, strict=True):
        rows = logits[row : row + len(segment.ids)] if segment.decoding else logits[row][None]
        row += len(rows)
        if stream.prefilling:
            stream.prefilled += len(segment.ids)
            if stream.prefilling:
                continue  # more prompt to read: no token yet
        before = stream.drafted, stream.accepted
        try:
            verify(stream, rows, segment.ids[1:] if segment.decoding else [], eos_ids, pieces)
        except Exception as exc:  # its own rows only: the other rows are already computed
            stream.fail(exc)
        drafted += stream.drafted - before[0]
        accepted += stream.accepted - before[1]
    return drafted, accepted


def verify(stream, rows: torch.Tensor, draft: list[int], eos_ids: set[int], pieces) -> None:
    """Pick a token from each row in turn while the picks agree with the draft: the
    picks are the answer (what single steps would have given, row for row), the draft
    only decided how many rows there were. The cache is cut back past the first row
    whose input was a draft the model did not pick; the stream counts its drafted and
    accepted tokens."""
    taken = accepted = 0
    for scores in rows:
        token = advance(stream, scores, eos_ids, pieces)
        taken += 1
        if stream.finish is not None or accepted == len(draft) or token != draft[accepted]:
            break
        accepted += 1
    stream.steps += 1
    if draft:
        stream.drafted += len(draft)
        stream.accepted += accepted
        stream.lookup.verified(len(draft), accepted)
    if taken < len(rows) and stream.cache is not None:
        stream.cache.crop(stream.cache.length - (len(rows) - taken))


def advance(stream, scores: torch.Tensor, eos_ids: set[int], pieces) -> int:
    """Pick the stream's next token from its logits and decide whether it is done. The
    logit bias, the penalties and the grammar's mask change `scores` first; logprobs are of
    what they left, before temperature and the top_k/top_p/min_p cuts (a greedy and a
    sampled request report the same numbers). A thinking model's thought
    (ThoughtSplit, below) is free of the grammar and has no logprobs; the server
    may write its markers itself."""
    split = stream.split
    token = split.forced() if split is not None else None
    answering = split is None or not split.thinking
    sampling = stream.sampling
    if token is None:
        if stream.bias is not None:
            stream.bias.apply_(scores)
        if stream.penalties is not None:
            stream.penalties.apply_(scores)
        if stream.constraint is not None and answering:
            stream.constraint.mask_(scores)
        token = sampler.pick(
            scores,
            sampling.temperature,
            sampling.top_p,
            stream.generator(),
            top_k=sampling.top_k,
            min_p=sampling.min_p,
        )
    if token in eos_ids and split is not None and split.thinking and stream.constraint is not None:
        token = split.close_id  # the constrained answer is still owed: close, do not end
    thought, thought_text = split.take(token) if split is not None else (False, "")
    if stream.constraint is not None and not thought:
        stream.constraint.take(token)
    if stream.penalties is not None:
        stream.penalties.add(token)
    if sampling.logprobs and token not in eos_ids and not thought:
        stream.add_logprob(logprob(pieces, scores, token, sampling.top_logprobs))
    if stream.completion_tokens == 0:
        stream.ttft_s = time.monotonic() - stream.opened
    stream.completion_tokens += 1
    stream.answer_ids.append(token)
    stream.token = token
    if stream.lookup is not None:
        stream.lookup.extend([token])
    if token in eos_ids:
        stream.finish = "stop"
        return token
    if thought:
        stream.add_thought(thought_text)
    else:
        text = stream.text.add(token)
        stream.add_text(split.answer(text) if split is not None else text)
    if stream.text.stopped or (stream.constraint is not None and stream.constraint.finished):
        stream.finish = "stop"
    elif stream.completion_tokens >= stream.budget:
        stream.finish = "length"
    return token


def logprob(pieces, scores: torch.Tensor, token: int, alternatives: int) -> TokenLogprob:
    """The token's entry with its `alternatives` most likely rivals (sampler.logprobs)."""
    chosen, best = sampler.logprobs(scores, token, alternatives)
    return _entry(pieces, token, chosen, tuple(_entry(pieces, i, v) for i, v in best))


def _entry(pieces, token: int, value: float, top: tuple = ()) -> TokenLogprob:
    text, raw = pieces.piece(token)
    return TokenLogprob(text, value, raw, top)


# -- detokenizing ---------------------------------------------------------------------------


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


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the character that stands for each byte in a
    byte-level BPE vocabulary (Qwen's, SmolLM2's) -> that byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


class TokenPieces:
    """Each token's text and true bytes, as OpenAI's logprobs give them: the bytes the token
    adds to the answer (a piece of a character is a byte or two, not U+FFFD), the text those
    bytes spell, or `bytes:\\xe5\\x9b` where they spell no whole character. Special tokens,
    which the answer leaves out, have no bytes. Kept per id once asked: the worker thread
    alone uses it."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        decoder = getattr(backend, "decoder", None)
        self._byte_level = "ByteLevel" in repr(decoder)
        self._alphabet = _byte_decoder()
        self._special = set(getattr(tokenizer, "all_special_ids", ()))
        self._known: dict[int, tuple[str, tuple[int, ...]]] = {}

    def piece(self, token_id: int) -> tuple[str, tuple[int, ...]]:
        """(token text, bytes) of one id."""
        known = self._known.get(token_id)
        if known is None:
            known = self._known[token_id] = self._read(token_id)
        return known

    def _read(self, token_id: int) -> tuple[str, tuple[int, ...]]:
        name = self._tokenizer.convert_ids_to_tokens(token_id)
        if name is None:  # a row of the logits past the tokenizer's vocabulary (padding)
            return "", ()
        if token_id in self._special:
            return name, ()
        if self._byte_level and all(c in self._alphabet for c in name):
            raw = bytes(self._alphabet[c] for c in name)
        else:  # an added token written as itself, or a tokenizer that is not byte-level
            raw = self._tokenizer.decode([token_id]).encode("utf-8")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
        return text, tuple(raw)


# -- a thinking model's thought ---------------------------------------------------------------

TAIL = 8  # prompt tokens read for where the template left the model: inside a thought or not


class ThoughtSplit:
    def __init__(
        self,
        markers: tuple[int, int],
        prompt_ids: list[int],
        budget: int,
        tokenizer,
        most: int | None = None,
        constrained: bool = False,
        think: bool | None = None,
    ):
        """`markers`: the ids of `<think>` and `</think>`. `most`: the most thought tokens
        allowed (--thinking-budget), beside the budget's own rule. `constrained`: the answer
        follows a grammar (a schema, tools), so a model left free to think opens its thought
        with the server's `<think>` rather than the grammar's first token; not when `think`
        (the switch the prompt was made with) is off: a template may ignore the switch, and
        the server does not think for it."""
        self.open_id, self.close_id = markers
        tail = prompt_ids[-TAIL:]
        last = max((i for i, t in enumerate(tail) if t in markers), default=None)
        # The template's own choice: inside a thought (it wrote <think>), past one (an empty
        # thought: thinking off), or neither (the model opens one or not)
        self.thinking = last is not None and tail[last] == self.open_id
        self.answering = last is not None and tail[last] == self.close_id
        self.must_open = constrained and think is not False
        self.must_open = self.must_open and not (self.thinking or self.answering)
        self.limit = thought_limit(budget)
        if most is not None:
            self.limit = min(self.limit, most)
        self.tokens = 0  # thought tokens so far
        self.cut = False  # the server closed the thought
        self._text = TextAssembler(tokenizer, ())
        self._started = False  # thought text given out yet (its leading newlines dropped)
        self._newlines = ""  # trailing newlines held back: dropped if the thought ends here
        self._answer_started = False

    def forced(self) -> int | None:
        """The token the server writes instead of the model's pick, if any: `<think>` to
        open a thought `must_open` asks for, `</think>` once the thought reached its limit."""
        if self.must_open:
            return self.open_id
        if self.thinking and self.tokens >= self.limit:
            self.cut = True
            return self.close_id
        return None

    def close_soon(self) -> None:
        """Close the thought at the next token (its deadline nears: Batch.settle)."""
        self.limit = min(self.limit, self.tokens)

    def take(self, token: int) -> tuple[bool, str]:
        """(whether `token` is the thought's, a marker included; the thought text it lets
        out)."""
        if token == self.open_id and not (self.thinking or self.answering):
            self.thinking, self.must_open = True, False
            return True, ""
        if not self.thinking:
            self.answering = True
            return False, ""
        if token == self.close_id:
            self.thinking, self.answering = False, True
            return True, self._trimmed(self._text.flush(), last=True)
        self.tokens += 1
        return True, self._trimmed(self._text.add(token))

    def flush(self) -> str:
        """At the end of a stream still thinking: the thought's held-back text."""
        return self._trimmed(self._text.flush(), last=True) if self.thinking else ""

    def answer(self, piece: str) -> str:
        """The answer's text, the newlines between a thought and it dropped."""
        if not self._answer_started:
            piece = piece.lstrip("\n")
            self._answer_started = bool(piece)
        return piece

    def _trimmed(self, piece: str, last: bool = False) -> str:
        if not self._started:
            piece = piece.lstrip("\n")
            self._started = bool(piece)
        piece, self._newlines = self._newlines + piece, ""
        if last:
            return piece.rstrip("\n")
        body = piece.rstrip("\n")
        self._newlines = piece[len(body) :]
        return body
