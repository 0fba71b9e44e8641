"""A thinking model's thought, kept apart from its answer (Qwen3 writes it between the tokens
`<think>` and `</think>`): which tokens are thought, their text, and when the server closes
a thought itself so that the answer still gets its room within the budget.

The accept stage (inference/runtime/accept.py) asks, per token, whether the server writes
it (`forced`) and whether it is thought (`take`); the grammar, the stop strings and the
logprobs are the answer's only. The newlines the template puts around a thought
(`<think>\\n...\\n</think>\\n\\n`) are not part of either text.
"""

from __future__ import annotations

from inference.runtime.accept import TextAssembler

# The answer keeps at least this many tokens of its budget, or a quarter of a small budget:
# a thought may not eat it all (the server closes the thought before).
ANSWER_ROOM = 64
TAIL = 8  # prompt tokens read for where the template left the model: inside a thought or not


MARKERS = 2  # tokens the answer's room also pays: `</think>` and the newlines after it


def answer_room(budget: int) -> int:
    return min(ANSWER_ROOM, budget // 4)


def thought_limit(budget: int) -> int:
    """The most thought tokens (markers not counted) a budget allows: the answer keeps its
    room, and the close and the newlines after it fit too."""
    return max(budget - answer_room(budget) - MARKERS, 0)


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
