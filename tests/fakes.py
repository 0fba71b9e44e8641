"""A scripted engine for tests about queueing and timing, where the real model is slow."""

from __future__ import annotations

import threading
import time

from inference.jobs import Generation
from inference.prompt import PromptBuilder


class FakeEngine:
    """Emits words `w1 w2 ...` (or the pieces of `reply`, then stops), one per `token_s`
    seconds; records the order jobs ran in."""

    name = "fake"

    def __init__(
        self,
        token_s: float = 0.01,
        fail_on: str | None = None,
        prefill_s: float = 0.0,
        reply: list[str] | None = None,
        prefill_token_s: float = 0.0,
    ):
        self.token_s = token_s
        self.reply = reply
        self.fail_on = fail_on
        self.prefill_s = prefill_s  # an uninterruptible pause before the first token
        self.prefill_token_s = prefill_token_s  # more of it per prompt token
        self.ran: list[list[int]] = []  # prompt ids, in the order generation started
        self.tokens_made: list[int] = []  # tokens produced per run
        self.started = threading.Event()

    def run(self, prompt_ids, sampling, emit, should_stop) -> Generation:
        self.ran.append(list(prompt_ids))
        self.started.set()
        if self.fail_on is not None and prompt_ids == [ord(c) for c in self.fail_on]:
            raise RuntimeError("scripted failure")
        made = 0
        started = time.monotonic()
        time.sleep(self.prefill_s + self.prefill_token_s * len(prompt_ids))
        ttft_s = 0.0
        try:
            while made < sampling.max_tokens:
                if should_stop():
                    return Generation("interrupted", made, ttft_s)
                time.sleep(self.token_s)
                made += 1
                ttft_s = ttft_s or time.monotonic() - started
                emit(f"w{made} " if self.reply is None else self.reply[made - 1])
                if self.reply is not None and made == len(self.reply):
                    return Generation("stop", made, ttft_s)
            return Generation("length", made, ttft_s)
        finally:
            self.tokens_made.append(made)


class FakePrompts(PromptBuilder):
    """Encodes a chat as the code points of the last message: readable ids for FIFO checks."""

    def __init__(self, context_tokens: int = 4096):
        super().__init__(tokenizer=None, context_tokens=context_tokens)

    def encode(self, messages, system=None):
        return [ord(c) for c in messages[-1]["content"]]
