"""A Job: one validated request on its way through the FIFO, with its deadline, cancel flag and
its own reply queue. The worker puts text deltas on `events`, then exactly one terminal item.
"""

from __future__ import annotations

import queue
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from service.errors import ServiceError

if TYPE_CHECKING:
    from inference.runtime.grammar import Grammar


@dataclass(frozen=True)
class Sampling:
    max_tokens: int
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None  # same seed, same request: same text
    grammar: Grammar | None = None  # constrains the answer to a JSON schema
    top_k: int = 0  # 0 (or less): off
    min_p: float = 0.0  # 0: off
    repetition_penalty: float = 1.0  # HF/vLLM's, on prompt and answer tokens; 1: off
    frequency_penalty: float = 0.0  # OpenAI's, on answer tokens, per occurrence
    presence_penalty: float = 0.0  # OpenAI's, on answer tokens, once
    logprobs: bool = False  # each answer token's log-probability
    top_logprobs: int = 0  # with logprobs: that many most likely alternatives per token
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, amount added to its logit)
    thinking_budget: int | None = None  # the most thought tokens (--thinking-budget)
    think: bool | None = None  # the thinking switch the prompt was made with (None: auto)


@dataclass(frozen=True)
class Range:
    """The values a sampling field may hold: [low, high], or (low, high] when `low_open`."""

    low: float
    high: float
    low_open: bool = False
    integer: bool = False

    def holds(self, value: float) -> bool:
        return self.low <= value <= self.high and not (self.low_open and value == self.low)

    def __str__(self) -> str:
        if self.integer:
            return f"an integer from {self.low:d} to {self.high:d}"
        return f"in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}]"


# The one table of what a request, or a model's generation_config.json, may set
# (web/dialects/validation.py, inference/loading/assemble.py). repetition_penalty is a factor
# (1: off) and models ship 1.0-1.3: past 10 it only garbles answers, so a larger value is
# taken for a mistake, and so is one under 0.1 (it multiplies a logit by its inverse: at
# 1e-300 the logits overflowed to inf and the sampler failed, a 500 found by fuzzing). A
# top_k past any vocabulary is off, as are 0 and -1 (vLLM's word for it). The penalties and
# top_logprobs have OpenAI's ranges.
SAMPLING_RANGES = {
    "temperature": Range(0.0, 2.0),
    "top_p": Range(0.0, 1.0, low_open=True),
    "top_k": Range(-1, 1_000_000, integer=True),  # 0 or -1: off
    "min_p": Range(0.0, 1.0),
    "repetition_penalty": Range(0.1, 10.0),
    "frequency_penalty": Range(-2.0, 2.0),
    "presence_penalty": Range(-2.0, 2.0),
    "top_logprobs": Range(0, 20, integer=True),
}


@dataclass(frozen=True)
class SamplingDefaults:
    """What a request that leaves these out gets: the model's generation_config.json, or
    greedy (`--sampling-defaults`); `source` says which, for /health and /v1/models."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    source: str = "greedy"

    def values(self) -> dict:
        """The defaults themselves, without `source`."""
        return {k: v for k, v in asdict(self).items() if k != "source"}

    def fill(self, **asked) -> dict:
        """The asked values, each None replaced by its default."""
        defaults = self.values()
        return {key: defaults[key] if value is None else value for key, value in asked.items()}

    def as_dict(self) -> dict:
        return {**self.values(), "source": self.source}


@dataclass(frozen=True)
class Generation:
    """What the engine reports of one run (the worker turns it into Done or Failed)."""

    finish_reason: str  # "stop" | "length" | "interrupted"
    completion_tokens: int
    ttft_s: float  # start of run() to the first token
    drafted: int = 0  # tokens drafted for it and checked (inference/runtime/schedule.py)
    accepted: int = 0  # of them, the ones the model picked: answer tokens without a step
    steps: int = 0  # forwards that gave it at least one token
    # The engine's own work on its prompt: the rows it computed (those taken from the prefix
    # cache not counted) and their share of the forwards' time. Admission's rate comes from
    # these, not from the time to the first token, which waits on the rows beside it.
    prefill_tokens: int = 0
    prefill_s: float = 0.0
    thought_cut: bool = False  # the thought was closed by the server (ThoughtSplit)


@dataclass(frozen=True)
class TokenLogprob:
    """One token's log-probability (or an alternative's, then `top` is empty): its text as
    OpenAI writes it, its true bytes, and with top_logprobs the most likely tokens there."""

    token: str
    logprob: float
    bytes: tuple[int, ...]
    top: tuple[TokenLogprob, ...] = ()

    def as_dict(self, alternatives: bool = True) -> dict:
        """OpenAI's entry: {"token", "logprob", "bytes", "top_logprobs": [...]}."""
        entry = {"token": self.token, "logprob": self.logprob, "bytes": list(self.bytes)}
        if alternatives:
            entry["top_logprobs"] = [t.as_dict(alternatives=False) for t in self.top]
        return entry


@dataclass(frozen=True)
class Delta:
    """Answer text, and the logprob entries of the tokens picked since the last Delta (their
    text may come in a later Delta: the detokenizer holds back partial characters and what
    could grow into a stop string)."""

    text: str
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class Thought:
    """Text of the model's thought (Qwen3's, between `<think>` and `</think>`), never part
    of the answer: each dialect names it its own way (reasoning_content, thinking)."""

    text: str


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class Done:
    """Terminal: the answer is complete. Times are in milliseconds."""

    finish_reason: str  # "stop" | "length"
    usage: Usage
    queued_ms: float
    ttft_ms: float
    total_ms: float
    tokens_per_second: float
    draft_tokens: int = 0  # answer tokens that came from verified drafts
    drafted_tokens: int = 0  # tokens drafted and checked, taken or not
    steps: int = 0  # forwards that gave the answer at least one token
    thought_cut: bool = False  # the server closed the thought to leave the answer its room

    def timings(self) -> dict:
        return {
            "queued_ms": round(self.queued_ms, 1),
            "ttft_ms": round(self.ttft_ms, 1),
            "total_ms": round(self.total_ms, 1),
            "tokens_per_second": round(self.tokens_per_second, 2),
            "draft_tokens": self.draft_tokens,
            "drafted_tokens": self.drafted_tokens,
            "decode_steps": self.steps,
        }


@dataclass(frozen=True)
class Failed:
    """Terminal: the job ended with an error, which the web layer renders."""

    error: ServiceError


Event = Thought | Delta | Done | Failed


def new_request_id() -> str:
    return "chat-" + uuid.uuid4().hex[:16]


@dataclass
class Job:
    prompt_ids: list[int]
    sampling: Sampling
    timeout_s: float
    id: str = field(default_factory=new_request_id)
    created: float = field(default_factory=time.monotonic)
    events: queue.Queue = field(default_factory=queue.Queue)
    started: bool = False  # set by the worker when it takes the job
    _cancelled: threading.Event = field(default_factory=threading.Event)

    @property
    def deadline(self) -> float:
        return self.created + self.timeout_s

    def expired(self) -> bool:
        return time.monotonic() >= self.deadline

    def cancel(self) -> None:
        """Called by the HTTP side when its client leaves; the worker reads it every token."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()
