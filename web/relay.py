"""The one path from a checked ChatRequest to an answer, shared by every dialect.

`submit()` turns the request into a Job and hands it to the worker; `events()` relays the
job's reply queue while watching the client (gone: cancel the job) and the deadline (passed:
504); with tools, `read_calls()` takes the calls out of the answer's text; `collect()` and
`sse()` (or `stream()`, any media type) deliver it as one answer or as a stream. A dialect
supplies only the shapes: a StreamShape for events, a dict for the whole answer.
"""

from __future__ import annotations

import itertools
import json
import queue
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Protocol

from flask import Response

from inference.runtime import tools as tool_format
from inference.runtime.budget import answer_budget
from inference.runtime.grammar import Grammar
from inference.runtime.jobs import (
    Delta,
    Done,
    Event,
    Failed,
    Job,
    Sampling,
    Thought,
    TokenLogprob,
)
from inference.runtime.tools import CallArguments, CallEnd, CallPiece, CallReader, CallStart
from inference.runtime.worker import Worker
from service.config import Config
from service.errors import (
    Cancelled,
    InvalidRequest,
    Loading,
    Overloaded,
    PayloadTooLarge,
    ServiceError,
    Timeout,
)
from web.dialects.validation import ChatRequest
from web.errors import status_of
from web.request_log import RequestLog
from web.runtime import Runtime

# --thinking: the template's own default (auto), or the switch set for every request
SERVER_THINKING = {"auto": None, "on": True, "off": False}
POLL_S = 0.05  # how often a waiting handler looks at its client and its job
# A running job's deadline is enforced by the worker between tokens; this is only the
# handler's guard against a generation step that never returns.
RUNNING_GRACE_S = 5.0
# Admission refuses only when the estimate of queue wait plus prefill passes the deadline by
# more than this factor: the rates are averages, and a request that might fit is let in.
ADMIT_SLACK = 1.25


def submit(chat_request: ChatRequest, config: Config, runtime: Runtime, request_id: str) -> Job:
    """The one place a checked request becomes a Job on the FIFO: prompt ids, limits,
    deadline. A full queue refuses before the tokenizer's work."""
    if not runtime.ready:
        raise Loading()
    runtime.worker.check_room()
    prompt_ids, grammar, bias = prepare(chat_request, config, runtime)
    runtime.prompts.check_fits(len(prompt_ids))
    prefixes = runtime.prefixes
    cached = prefixes.cached_tokens(prompt_ids) if prefixes is not None else 0
    admit(len(prompt_ids), config, runtime.worker, cached)
    sampling = Sampling(
        max_tokens=answer_budget(
            len(prompt_ids),
            chat_request.max_tokens or config.max_tokens_default,
            runtime.prompts.context_tokens,
            cap=config.max_tokens_cap,
        ),
        stop=chat_request.stop,
        seed=chat_request.seed,
        grammar=grammar,
        frequency_penalty=chat_request.frequency_penalty,
        presence_penalty=chat_request.presence_penalty,
        logprobs=chat_request.logprobs,
        top_logprobs=chat_request.top_logprobs,
        logit_bias=bias,
        thinking_budget=config.thinking_budget or None,
        think=thinking_switch(chat_request, config.thinking),
        **runtime.defaults.fill(
            temperature=chat_request.temperature,
            top_p=chat_request.top_p,
            top_k=chat_request.top_k,
            min_p=chat_request.min_p,
            repetition_penalty=chat_request.repetition_penalty,
        ),
    )
    job = Job(prompt_ids, sampling, timeout_s=config.request_timeout, id=request_id)
    return runtime.worker.submit(job)


def prepare(
    chat_request: ChatRequest, config: Config, runtime: Runtime
) -> tuple[list[int], Grammar | None, tuple]:
    """What a request is answered from, each part checked: its prompt's token ids, its
    constraint compiled, its logit bias against the vocabulary. A chat route and its
    /tokenize both run this, so the one refuses exactly what the other refuses."""
    bias = _logit_bias(chat_request.logit_bias, runtime)
    grammar = _grammar(chat_request, runtime)
    if chat_request.think and chat_request.think_param and not runtime.prompts.thinks:
        raise InvalidRequest(
            f"'{chat_request.think_param}' asks for a thought, but {runtime.model_name} does "
            "not think before it answers",
            param=chat_request.think_param,
        )
    return prompt_of(chat_request, runtime, config.thinking), grammar, bias


def thinking_switch(chat_request: ChatRequest, thinking: str) -> bool | None:
    """The request's switch, else the server's --thinking (None: the template's default)."""
    return chat_request.think if chat_request.think is not None else SERVER_THINKING[thinking]


def prompt_of(chat_request: ChatRequest, runtime: Runtime, thinking: str = "auto") -> list[int]:
    """The prompt's token ids: the chat template over the messages, the system text and the
    tools' definitions, or a raw prompt (Ollama's `raw`) as the client wrote it. What a
    request is answered from and what /tokenize counts. The thinking switch: the request's,
    else the server's `thinking` (--thinking)."""
    if chat_request.raw is not None:
        return runtime.prompts.encode_raw(chat_request.raw)
    functions = chat_request.tools.functions if chat_request.tools else None
    think = thinking_switch(chat_request, thinking)
    return runtime.prompts.encode(chat_request.messages, chat_request.system, functions, think)


def _logit_bias(bias: tuple, runtime: Runtime) -> tuple:
    """The bias, each token id checked against the tokenizer's (as /detokenize checks) and
    the logits' width, where a model has fewer rows than its tokenizer has ids."""
    if not bias:
        return bias
    vocabulary = runtime.prompts.with_tokenizer(len)
    vocabulary = min(vocabulary, runtime.logits_width or vocabulary)
    for token, _ in bias:
        if token >= vocabulary:
            raise InvalidRequest(
                f"'logit_bias' names token {token}; this model's ids are 0 to {vocabulary - 1}",
                param="logit_bias",
            )
    return bias


def _grammar(chat_request: ChatRequest, runtime: Runtime) -> Grammar | None:
    """The answer's constraint: the JSON schema asked for, or with tools the call format
    (inference/runtime/tools.py). Each function's schema is compiled alone first, so that a
    bad one is refused naming its own field."""
    use, json_schema = chat_request.tools, chat_request.json
    if use is None and json_schema is None:
        return None
    if runtime.grammars is None:
        raise InvalidRequest(
            "this server cannot constrain answers", param="tools" if use else json_schema.param
        )
    if use is None:
        return runtime.grammars.compile(json_schema.schema, json_schema.param)
    for function in use.functions:
        runtime.grammars.compile(tool_format.argument_schema(function.parameters), function.param)
    lark = tool_format.grammar(use, runtime.prompts.tags_are_tokens)
    return runtime.grammars.compile_lark(lark, "tools")


def admit(prompt_tokens: int, config: Config, worker: Worker, cached_tokens: int = 0) -> None:
    """Refuse now a prompt whose prefill alone could never end within the deadline (413), or
    one that cannot get its first token before the deadline behind the queue ahead (503,
    retry when enough of the queue has drained). Queue wait and prefill come from the
    worker's measured averages; before anything was measured, nothing is refused here (the
    prompt's length was checked by `PromptBuilder.check_fits`). Only the tokens the prefix
    cache does not hold (`cached_tokens`) are prefilled, so only they count: a tool's long
    system prompt, computed once, does not get its later requests refused (blocks the cache
    lets go before the job starts are computed again: an estimate, not a promise). The
    answer's own decode is not counted: max_tokens is a ceiling."""
    if not worker.measured:
        return
    deadline_s = config.request_timeout
    computed = prompt_tokens - cached_tokens
    prefill_s = worker.expected_prefill_s(computed)
    if prefill_s > deadline_s * ADMIT_SLACK:
        held = (
            f" ({cached_tokens} of them in the prefix cache); at the measured "
            f"{computed / prefill_s:.0f} prompt tokens/s its {computed} tokens to compute take"
            if cached_tokens
            else f"; at the measured {computed / prefill_s:.0f} prompt tokens/s its prefill "
            "alone takes"
        )
        raise PayloadTooLarge(
            f"the prompt is {prompt_tokens} tokens{held} about {prefill_s:.1f} s, more than "
            f"the {deadline_s:g} s request deadline"
        )
    wait_s = worker.expected_start_s(worker.depth)
    if wait_s + prefill_s > deadline_s * ADMIT_SLACK:
        raise Overloaded(
            f"the queue ahead needs about {wait_s:.1f} s and this prompt's prefill "
            f"{prefill_s:.1f} s, more than the {deadline_s:g} s request deadline; retry later",
            retry_after_s=wait_s + prefill_s - deadline_s,
        )


def start(
    chat_request: ChatRequest,
    config: Config,
    runtime: Runtime,
    request_id: str,
    disconnected: Callable[[], bool],
) -> tuple[Job, Iterator[Event | CallPiece]]:
    """Submit the request and relay its job's events, read for calls when it has tools."""
    job = submit(chat_request, config, runtime, request_id)
    relayed = events(job, disconnected)
    if chat_request.tools is not None:
        relayed = read_calls(relayed, chat_request.tools.forced)
    return job, relayed


def events(job: Job, disconnected: Callable[[], bool]) -> Iterator[Event]:
    """The job's events up to and including its terminal one; cancels it if the client left.

    Never waits forever: a queued job is given up at its deadline, a running one a little
    after, both as a Timeout.
    """
    while True:
        if disconnected():
            job.cancel()
            return
        try:
            event = job.events.get(timeout=POLL_S)
        except queue.Empty:
            grace = RUNNING_GRACE_S if job.started else 0.0
            if time.monotonic() > job.deadline + grace:
                job.cancel()
                yield Failed(Timeout(f"no answer within the {job.timeout_s:g} s deadline"))
                return
            continue
        yield event
        if not isinstance(event, Delta | Thought):
            return


def read_calls(relayed: Iterator[Event], forced: bool = False) -> Iterator[Event | CallPiece]:
    """The events with the answer's text read for tool calls: Deltas of the text outside
    them, the call pieces, and a Done whose finish_reason is "tool_calls" when the answer
    stopped after calling. `forced` (tool_choice "required" or a name): the grammar lets
    the answer hold calls alone, so no Delta at all; what would be one is a call cut by
    max_tokens before its tag was whole ("<tool_call"). Logprob entries go with the text
    before the first call, as OpenAI's `content` logprobs do, by bytes: a text Delta takes
    the entries of the tokens that begin within the text let out so far (a token holding
    both text and a tag's start goes with the text). From the first call on, entries are
    left out: the call's tokens, its tags included, and any text after it (one event may
    carry several tokens, drafted ones, across the tag)."""
    reader = CallReader()
    pending: deque[TokenLogprob] = deque()
    let_out = given = 0  # bytes of text let out, and of the entries given with it
    for event in relayed:
        if isinstance(event, Failed | Thought):
            yield event
            continue
        if isinstance(event, Delta):
            if not reader.calls:  # no call yet: entries still go with text
                pending.extend(event.logprobs)
            pieces = reader.feed(event.text)
        else:
            pieces = reader.finish()
        for piece in pieces:
            if isinstance(piece, Delta) and forced:
                continue
            if isinstance(piece, Delta):
                let_out += len(piece.text.encode())
                entries = []
                while pending and given < let_out:
                    entries.append(pending.popleft())
                    given += len(entries[-1].bytes)
                piece = replace(piece, logprobs=tuple(entries))
            elif isinstance(piece, CallStart):
                pending.clear()
            yield piece
        if isinstance(event, Done):
            if reader.calls and event.finish_reason == "stop":
                event = replace(event, finish_reason="tool_calls")
            yield event


@dataclass
class Call:
    """One call of a whole answer; `complete` unless max_tokens or a stop string cut it."""

    id: str
    name: str
    arguments: str = ""
    complete: bool = False


class WholeCalls:
    """For a stream that sends each call once it is whole: the pieces in, the call out."""

    def __init__(self):
        self._call: Call | None = None  # the call being read

    def feed(self, piece: CallPiece) -> Call | None:
        """The call `piece` ends, else None."""
        if isinstance(piece, CallStart):
            self._call = Call(piece.id, piece.name)
        elif isinstance(piece, CallArguments):
            self._call.arguments += piece.text
        else:
            return self._call
        return None


@dataclass
class Answer:
    """A whole answer: its text outside calls, its calls, its Done, its logprob entries
    (none unless asked) and a thinking model's thought ("" without one)."""

    text: str
    calls: list[Call]
    done: Done
    logprobs: list[TokenLogprob]
    thought: str = ""


def collect(relayed: Iterator[Event | CallPiece], log: RequestLog) -> Answer:
    """The whole answer; raises the job's error, or Cancelled if the client left."""
    parts: list[str] = []
    thought: list[str] = []
    calls: list[Call] = []
    logprobs: list[TokenLogprob] = []
    for event in relayed:
        if isinstance(event, Thought):
            thought.append(event.text)
        elif isinstance(event, Delta):
            parts.append(event.text)
            logprobs.extend(event.logprobs)
        elif isinstance(event, CallStart):
            calls.append(Call(event.id, event.name))
        elif isinstance(event, CallArguments):
            calls[event.index].arguments += event.text
        elif isinstance(event, CallEnd):
            calls[event.index].complete = True
        elif isinstance(event, Failed):
            raise event.error
        else:
            log.finish(200, event)
            return Answer("".join(parts), calls, event, logprobs, "".join(thought))
    raise Cancelled("the client went away")


class StreamShape(Protocol):
    """How one dialect writes a stream; each method returns whole pieces of it (SSE frames,
    or JSON lines)."""

    def begin(self, first: Event | CallPiece) -> list[str]: ...

    def delta(self, text: str, logprobs: tuple[TokenLogprob, ...]) -> list[str]: ...

    def thought(self, text: str) -> list[str]: ...

    def call(self, piece: CallPiece) -> list[str]: ...

    def done(self, done: Done) -> list[str]: ...

    def error(self, error: ServiceError) -> list[str]: ...


def sse_frame(data: dict | str, event: str | None = None) -> str:
    head = f"event: {event}\n" if event else ""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"{head}data: {payload}\n\n"


def sse(
    job: Job, relayed: Iterator[Event | CallPiece], shape: StreamShape, log: RequestLog
) -> Response:
    """A text/event-stream response (the shape writes SSE frames)."""
    return stream(job, relayed, shape, log, "text/event-stream")


def stream(
    job: Job,
    relayed: Iterator[Event | CallPiece],
    shape: StreamShape,
    log: RequestLog,
    mimetype: str,
) -> Response:
    """A streamed response of the shape's pieces (SSE frames, or Ollama's JSON lines). An
    error before the first event is a plain HTTP error with its status (raised here); after
    that it is the dialect's error piece, then the end."""
    first = next(relayed, None)
    if isinstance(first, Failed):
        raise first.error
    if first is None:
        raise Cancelled("the client went away")

    def body() -> Iterator[str]:
        status, done, failure = 499, None, None
        try:
            yield from shape.begin(first)
            for event in itertools.chain([first], relayed):
                if isinstance(event, Thought):
                    yield from shape.thought(event.text)
                elif isinstance(event, Delta):
                    yield from shape.delta(event.text, event.logprobs)
                elif isinstance(event, CallPiece):
                    yield from shape.call(event)
                elif isinstance(event, Done):
                    status, done = 200, event
                    yield from shape.done(event)
                else:
                    status, failure = status_of(event.error), event.error
                    yield from shape.error(event.error)
        finally:
            job.cancel()  # a no-op when finished; stops the worker when the client left
            log.finish(status, done, failure)

    return Response(
        body(),
        mimetype=mimetype,
        # No Content-Length: waitress sends it chunked and closes the connection at the end,
        # so clients that read until the server closes also see the end.
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
