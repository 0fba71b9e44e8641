"""A scripted engine for tests about queueing and timing, where the real model is slow; its
prompt ids (code points) and a reader of a job's events to the end."""

from __future__ import annotations

import threading
import time

from inference.runtime.jobs import Delta, Generation, Job, TokenLogprob
from inference.runtime.prompt import PromptBuilder


class FakeStream:
    def __init__(self, prompt_ids, sampling, prefill_s: float):
        self.prompt_ids = prompt_ids
        self.sampling = sampling
        self.prefill_s = prefill_s  # still to sleep before the first token
        self.prefill_total_s = prefill_s  # what the scripted prefill costs in all
        self.opened = time.monotonic()
        self.finish: str | None = None if sampling.max_tokens > 0 else "length"
        self.completion_tokens = 0
        self.ttft_s = 0.0
        self.text = ""
        self.thought = ""
        self.logprobs: list[TokenLogprob] = []
        self.error = None

    def take_text(self) -> str:
        text, self.text = self.text, ""
        return text

    def take_thought(self) -> str:
        text, self.thought = self.thought, ""
        return text

    def take_logprobs(self) -> tuple[TokenLogprob, ...]:
        entries, self.logprobs = tuple(self.logprobs), []
        return entries


class FakeEngine:
    """Emits words `w1 w2 ...` (or the pieces of `reply`, then stops; after the pieces of
    `thought` as thought, when given), one per `token_s`
    seconds per step, whatever the number of streams in the step (a batch costs what one
    stream does); records the order jobs started in and the sampling each job got. With
    logprobs asked, each piece is a token of log-probability -0.5, its alternatives the
    same piece in upper case at -1, -2, ..."""

    name = "fake"
    batch_invariant = True

    def __init__(
        self,
        token_s: float = 0.01,
        fail_on: str | None = None,
        prefill_s: float = 0.0,
        reply: list[str] | None = None,
        prefill_token_s: float = 0.0,
        bytes_per_token: int = 0,
        thought: list[str] | None = None,
    ):
        self.token_s = token_s
        self.reply = reply
        self.thought = thought or []
        self.fail_on = fail_on
        self.prefill_s = prefill_s  # an uninterruptible pause before the first token
        self.prefill_token_s = prefill_token_s  # more of it per prompt token
        self.bytes_per_token = bytes_per_token  # KV cache a job reserves, per token
        self.ran: list[list[int]] = []  # prompt ids, in the order generation started
        self.samplings: list = []  # the Sampling of each job, in the same order
        self.tokens_made: list[int] = []  # tokens produced per job
        self.batch_sizes: list[int] = []  # streams per step
        self.last_forward: tuple[int, float] | None = None
        self.started = threading.Event()
        self.idled = 0  # calls of idle(): the worker's long enough without work

    def idle(self) -> None:
        self.idled += 1

    def cache_bytes(self, prompt_tokens: int, max_tokens: int) -> int:
        return self.bytes_per_token * (prompt_tokens + max_tokens)

    def open(self, prompt_ids, sampling) -> FakeStream:
        self.ran.append(list(prompt_ids))
        self.samplings.append(sampling)
        self.started.set()
        if self.fail_on is not None and prompt_ids == [ord(c) for c in self.fail_on]:
            raise RuntimeError("scripted failure")
        prefill_s = self.prefill_s + self.prefill_token_s * len(prompt_ids)
        return FakeStream(list(prompt_ids), sampling, prefill_s)

    def step(self, streams: list[FakeStream]) -> None:
        active = [s for s in streams if s.finish is None]
        self.batch_sizes.append(len(active))
        started = time.perf_counter()
        for stream in active:
            time.sleep(stream.prefill_s)
            stream.prefill_s = 0.0
        time.sleep(self.token_s)
        self.last_forward = (len(active), time.perf_counter() - started)
        for stream in active:
            stream.completion_tokens += 1
            made = stream.completion_tokens
            stream.ttft_s = stream.ttft_s or time.monotonic() - stream.opened
            answered = made - len(self.thought)  # answer tokens so far
            if answered <= 0:
                stream.thought += self.thought[made - 1]
            else:
                piece = f"w{answered} " if self.reply is None else self.reply[answered - 1]
                stream.text += piece
                if stream.sampling.logprobs:
                    stream.logprobs.append(fake_logprob(piece, stream.sampling.top_logprobs))
            if self.reply is not None and answered == len(self.reply):
                stream.finish = "stop"
            elif made >= stream.sampling.max_tokens:
                stream.finish = "length"

    def close(self, stream: FakeStream, interrupted: bool = False) -> Generation:
        self.tokens_made.append(stream.completion_tokens)
        finish = "interrupted" if interrupted or stream.finish is None else stream.finish
        return Generation(
            finish,
            stream.completion_tokens,
            stream.ttft_s,
            prefill_tokens=len(stream.prompt_ids),
            prefill_s=stream.prefill_total_s,
        )


def fake_logprob(piece: str, alternatives: int) -> TokenLogprob:
    def entry(text: str, logprob: float, top=()) -> TokenLogprob:
        return TokenLogprob(text, logprob, tuple(text.encode()), tuple(top))

    top = [entry(piece.upper(), -1.0 - i) for i in range(alternatives)]
    return entry(piece, -0.5, top)


class CodePoints:
    """FakePrompts' tokenizer: every Unicode code point is a token id."""

    def __len__(self) -> int:
        return 0x110000

    def decode(self, ids: list[int]) -> str:
        return "".join(map(chr, ids))


class FakePrompts(PromptBuilder):
    """Encodes a chat as the code points of the last message: readable ids for FIFO checks."""

    def __init__(self, context_tokens: int = 4096, max_prompt_tokens: int | None = None):
        super().__init__(CodePoints(), context_tokens, max_prompt_tokens)

    thinks = False  # a test sets it to stand for a thinking model

    def encode(self, messages, system=None, tools=None, think=None):
        self.think = think  # the switch the last prompt was rendered with
        return [ord(c) for c in messages[-1]["content"]]

    def encode_text(self, text: str) -> list[int]:
        return [ord(c) for c in text]


class FakeGrammars:
    """Stands in for the SchemaCompiler where a scripted engine ignores the grammar: records
    what it was asked to compile."""

    def __init__(self):
        self.schemas: list[tuple[dict, str]] = []
        self.larks: list[str] = []

    def compile(self, schema: dict, param: str):
        self.schemas.append((schema, param))

    def compile_lark(self, lark: str, param: str):
        self.larks.append(lark)


def ids(text: str) -> list[int]:
    return [ord(c) for c in text]


def terminal_events(job: Job, timeout: float = 10) -> tuple[list, object]:
    """All deltas, the terminal item, and a check that nothing follows it."""
    deltas = []
    while True:
        event = job.events.get(timeout=timeout)
        if isinstance(event, Delta):
            deltas.append(event.text)
            continue
        time.sleep(0.05)
        assert job.events.empty(), "something came after the terminal item"
        return deltas, event
