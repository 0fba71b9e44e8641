"""The decode loop, step by step over several jobs: open a stream, step them all, close one.

Each step is one forward (inference/model/decoder.py) over every open stream, in three
parts: schedule (which rows run: a decoding stream's token and its drafts, prompt chunks,
inference/runtime/schedule.py), run the forward, accept (each stream's tokens from its
rows: penalties, grammar, sampling, stop strings, text, inference/runtime/accept.py).
Every stream keeps its own sampling (temperature, top_p, top_k, min_p, penalties, seed,
stop strings, JSON grammar, logprobs), token budget and KV cache. With a prefix cache
(inference/model/prefix_cache.py) a stream starts from the longest prefix of its prompt
that any earlier stream computed and only runs the rest. With `speculate`, a decoding
stream's step also checks the tokens its prompt suggests will follow and keeps those the
model itself picks: the same answer in fewer steps. It knows nothing of HTTP, queues,
deadlines or chat messages: the worker thread decides who is open and calls `step()`;
`run()` is one stream alone, start to end.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from inference.host import heap
from inference.model.decoder import Decoder
from inference.model.kvcache import SequenceCache
from inference.model.prefix_cache import PrefixCache
from inference.runtime import sampler
from inference.runtime.accept import TextAssembler, ThoughtSplit, TokenPieces, accept
from inference.runtime.jobs import Generation, Sampling, TokenLogprob
from inference.runtime.prompt import THINK_CLOSE, THINK_OPEN
from inference.runtime.schedule import (
    ALIGN,
    PREFILL_BLOCK,
    PREFILL_CHUNK,
    PromptChunks,
    PromptLookup,
    schedule,
)


class Stream:
    """One job's generation inside the engine. The worker reads `finish`, `error`,
    `take_text()`, `take_logprobs()`, `completion_tokens` and `ttft_s`; the rest is the
    engine's."""

    def __init__(
        self, prompt_ids: list[int], sampling: Sampling, text, cache, speculate, split=None
    ):
        self.prompt_ids = prompt_ids
        self.split: ThoughtSplit | None = split  # a thinking model's thought and answer
        self.sampling = sampling
        self.budget = sampling.max_tokens  # decided at admission (inference/runtime/budget.py)
        self.text: TextAssembler = text
        self.cache: SequenceCache | None = cache
        self.lookup = PromptLookup(prompt_ids) if speculate else None
        self.drafted = self.accepted = 0  # tokens proposed by drafts, and taken from them
        self.steps = 0  # forwards that gave it at least one token
        self.constraint = sampling.grammar.constraint() if sampling.grammar else None
        self.bias = sampler.LogitBias.of(sampling)
        self.penalties = sampler.Penalties.of(prompt_ids, sampling)
        self.reused = cache.length if cache else 0  # prompt tokens from the prefix cache
        self.prefilled = self.reused  # prompt tokens in the cache so far
        self.token = -1  # the last token picked, the next decode step's input
        self.completion_tokens = 0
        self.answer_ids: list[int] = []  # the tokens picked, in order
        self.prefill_s = 0.0  # its prompt rows' share of the forwards' time
        self.finish: str | None = None if self.budget > 0 else "length"
        self.error: Exception | None = None  # what ended it inside a step; only it
        self.opened = time.monotonic()
        self.ttft_s = 0.0
        self._pending: list[str] = []
        self._thought: list[str] = []
        self._logprobs: list[TokenLogprob] = []

    @property
    def prefilling(self) -> bool:
        return self.prefilled < len(self.prompt_ids)

    def take_text(self) -> str:
        """The text produced since the last call (may be empty)."""
        text, self._pending = "".join(self._pending), []
        return text

    def take_thought(self) -> str:
        """The thought's text produced since the last call (may be empty)."""
        text, self._thought = "".join(self._thought), []
        return text

    def add_thought(self, piece: str) -> None:
        if piece:
            self._thought.append(piece)

    def take_logprobs(self) -> tuple[TokenLogprob, ...]:
        """The logprob entries of the tokens picked since the last call, in order."""
        entries, self._logprobs = tuple(self._logprobs), []
        return entries

    def add_logprob(self, entry: TokenLogprob) -> None:
        self._logprobs.append(entry)

    def add_text(self, piece: str) -> None:
        if piece:
            self._pending.append(piece)

    def fail(self, error: Exception) -> None:
        """Its sampling, grammar or text raised: it ends here, the step goes on without it."""
        self.error, self.finish = error, "error"

    def generator(self) -> torch.Generator | None:
        """The generator of the next token's draw: with a seed, one made from the seed and
        the token's position, so a token's draw is the same whether it came in a step of its
        own or verified in a draft; without, torch's global one."""
        if self.sampling.seed is None:
            return None
        return torch.Generator().manual_seed(_mix(self.sampling.seed, self.completion_tokens))

    def next_chunk(self, rows: int) -> list[int]:
        """Up to `rows` more prompt ids (`rows` and `prefilled` are multiples of the block,
        but for a prefix that ended inside one on the native step)."""
        return self.prompt_ids[self.prefilled : self.prefilled + rows]


class Engine:
    """Holds the model and the tokenizer it decodes answers with (the request handlers'
    prompt builder shares it, inference/runtime/prompt.py)."""

    def __init__(
        self,
        model,
        tokenizer,
        name: str,
        context_tokens: int,
        eos_ids: set[int],
        prefix_cache_bytes: int = 0,
        speculate: bool = False,
        native=None,
    ):
        self.model = model
        self.vocab_size = model.config.vocab_size  # the width of the logits
        self.tokenizer = tokenizer
        self.name = name
        self.context_tokens = context_tokens
        self.eos_ids = eos_ids
        self.decoder = Decoder(model, context_tokens, native)  # native: the plan's library
        self.pieces = TokenPieces(tokenizer)  # token text and bytes, for logprobs
        self.think_markers = think_markers(tokenizer)
        # True when every Linear is per-row int8: a row's result is the same in any batch
        # and any chunking, so several streams may share a step, and drafted tokens may be
        # verified beside the step's own (else a draft would change the answer).
        self.batch_invariant = self.decoder.rows_independent()
        self.speculate = speculate and self.batch_invariant
        self.drafted_tokens = self.accepted_tokens = 0  # all streams' drafts, since start
        self.last_forward: tuple[int, float] | None = None  # (rows, seconds): threads.py
        # Prompt prefixes' keys and values, shared by every stream (none when the budget is 0).
        # Elsewhere than on per-row weights a prefix's bits depend on how it was chunked:
        # only prompts (prefilled in fixed PREFILL_BLOCK chunks) are kept there, not answers.
        if self.batch_invariant:
            self.block, self.alone_rows = ALIGN, PREFILL_CHUNK
        elif prefix_cache_bytes > 0:
            self.block = self.alone_rows = PREFILL_BLOCK
        else:
            self.block = self.alone_rows = PREFILL_CHUNK
        # The native step's rows depend on their position alone: prompt chunks beside
        # answering streams (sized from measured steps) may have any number of rows there,
        # and a cached prefix may end inside a block; elsewhere whole blocks.
        native = self.decoder.native is not None
        self.chunks = PromptChunks(1 if native else self.block)
        self.prefixes = None
        if prefix_cache_bytes > 0:
            self.prefixes = PrefixCache(prefix_cache_bytes, self.block, partial=native)
        # What runs a step: the native library's build (inference/native) or torch's ops.
        self.decode_step = f"native {self.decoder.native}" if self.decoder.native else "torch"
        # Equal digests, equal answers on any PC: where the native step serves (the torch
        # step's integer rows follow the CPU's kernels), else None
        self.weights_digest = self.decoder.digest() if self.decoder.native else None
        self.reused_tokens = 0  # prompt tokens the last open() took from the prefix cache

    # -- one job's life ---------------------------------------------------------------------

    def set_threads(self, threads: int) -> None:
        """The thread count of the steps from here on (the thread governor's)."""
        self.decoder.set_threads(threads)

    def prefill_step_s(self, streams: list[Stream]) -> float | None:
        """Expected seconds of a step that computes every prefilling stream's whole rest of
        its prompt (the step that gives them their first tokens, or longer than any step
        that only starts it); None when none prefills or nothing is measured yet. The
        worker's bound on a real-time first step (inference/host/realtime.py)."""
        rows = sum(len(s.prompt_ids) - s.prefilled for s in streams if s.prefilling)
        return self.chunks.step_s(rows) if rows else None

    def idle(self) -> None:
        """Nothing has run for a while (the worker's IDLE_RELEASE_S): the finished jobs'
        cache buffers kept for the next ones leave RSS."""
        if len(self.decoder.spares):
            self.decoder.spares.clear()
            heap.trim()

    def cache_bytes(self, prompt_tokens: int, max_tokens: int) -> int:
        """The most KV cache memory a job of this size can take (the worker's admission):
        `max_tokens` is its answer budget, already decided (inference/runtime/budget.py)."""
        return (prompt_tokens + max_tokens) * self.decoder.bytes_per_token()

    def open(self, prompt_ids: list[int], sampling: Sampling) -> Stream:
        """A stream for the job; `sampling.max_tokens` is its answer budget, decided by
        inference/runtime/budget.py before it came here, and trusted: it must fit."""
        budget = sampling.max_tokens
        if len(prompt_ids) + budget > self.context_tokens:
            raise ValueError(
                f"{len(prompt_ids)} prompt tokens + a budget of {budget} pass the context "
                f"({self.context_tokens}); decide the budget with budget.answer_budget"
            )
        cache = None
        if budget > 0:
            cache = self.decoder.new_cache(len(prompt_ids) + budget)
            # The whole prompt's room at once: grown chunk by chunk (256, 512, 1024 ...) each
            # copy left its old buffer as a hole in the heap beside the others' caches.
            cache.reserve(len(prompt_ids))
            if self.prefixes is not None:
                self.prefixes.restore(prompt_ids, cache)
        text = TextAssembler(self.tokenizer, sampling.stop)
        split = None
        if self.think_markers is not None:
            split = ThoughtSplit(
                self.think_markers,
                prompt_ids,
                budget,
                self.tokenizer,
                most=sampling.thinking_budget,
                constrained=sampling.grammar is not None,
                think=sampling.think,
            )
        stream = Stream(prompt_ids, sampling, text, cache, self.speculate, split)
        self.reused_tokens = stream.reused
        return stream

    def close(self, stream: Stream, interrupted: bool = False) -> Generation:
        """Ends the stream and releases its cache, its prefix kept in the prefix cache. Its
        held-back text, if it finished, is left for one more take_text()."""
        finish = "interrupted" if interrupted or stream.finish is None else stream.finish
        if finish != "interrupted":
            if stream.split is not None:
                stream.add_thought(stream.split.flush())
            text = stream.text.flush()
            stream.add_text(stream.split.answer(text) if stream.split is not None else text)
        if self.prefixes is not None and stream.cache is not None and stream.error is None:
            computed = stream.prompt_ids[: stream.prefilled]
            if self.batch_invariant and not stream.prefilling:  # the answer's rows too
                computed = stream.prompt_ids + stream.answer_ids
            self.prefixes.keep(computed, stream.cache)
        if stream.cache is not None:
            stream.cache.release()  # its buffer serves a later job (SpareBuffers)
        stream.cache = None
        heap.trim()  # the job's freed activations leave RSS now, not never
        return Generation(
            finish,
            stream.completion_tokens,
            stream.ttft_s,
            drafted=stream.drafted,
            accepted=stream.accepted,
            steps=stream.steps,
            prefill_tokens=stream.prefilled - stream.reused,
            prefill_s=stream.prefill_s,
            thought_cut=stream.split is not None and stream.split.cut,
        )

    # -- the step ---------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self, streams: list[Stream]) -> None:
        """One forward over the open streams, in three parts: schedule the rows (a token
        for every decoding stream with its draft, prompt chunks of the first prefilling
        ones), run them, accept each stream's tokens from its rows. What one stream's own
        choices raise (its draft, sampling, grammar, text) ends that stream alone
        (`Stream.error`); the forward is everyone's."""
        plan = schedule(streams, self.alone_rows, self.block, self.chunks.beside())  # which rows
        if not plan.segments:
            return
        started = time.perf_counter()
        logits = self.decoder.forward(plan.segments)  # run them, all streams in one forward
        seconds = time.perf_counter() - started
        prompt_rows = sum(len(s.ids) for s in plan.segments if not s.decoding)
        rows = sum(len(segment.ids) for segment in plan.segments)
        self.last_forward = (rows, seconds)
        self.chunks.observe(rows - prompt_rows, prompt_rows, seconds)
        _share_prefill_time(plan, *self.last_forward)
        drafted, accepted = accept(plan, logits, self.eos_ids, self.pieces)  # their tokens
        self.drafted_tokens += drafted
        self.accepted_tokens += accepted

    # -- one stream alone -------------------------------------------------------------------

    def run(
        self,
        prompt_ids: list[int],
        sampling: Sampling,
        emit: Callable[[str], None],
        should_stop: Callable[[], bool],
    ) -> Generation:
        """A batch of one: open, step until finished or told to stop, close. Raises what
        ended the stream, if something did."""
        stream = self.open(prompt_ids, sampling)
        interrupted = False
        while stream.finish is None:
            if should_stop():
                interrupted = True
                break
            self.step([stream])
            if stream.error is not None:
                self.close(stream, interrupted=True)
                raise stream.error
            if text := stream.take_text():
                emit(text)
        result = self.close(stream, interrupted)
        if text := stream.take_text():
            emit(text)
        return result


def think_markers(tokenizer) -> tuple[int, int] | None:
    """The ids of `<think>` and `</think>` when the model's vocabulary has them as tokens of
    their own (Qwen3's), else None: no thought is split from its answers."""
    added = getattr(tokenizer, "added_tokens_encoder", {})
    if THINK_OPEN in added and THINK_CLOSE in added:
        return added[THINK_OPEN], added[THINK_CLOSE]
    return None


def _share_prefill_time(plan, rows: int, seconds: float) -> None:
    """Give each prompt chunk of the step its rows' share of the forward's `seconds` (a row
    costs about the same whichever stream it is: the weights are read once for all of them)."""
    for stream, segment in zip(plan.streams, plan.segments, strict=True):
        if not segment.decoding:
            stream.prefill_s += seconds * len(segment.ids) / rows


def _mix(seed: int, position: int) -> int:
    """A 64-bit seed for one position's draw (splitmix64 of the pair): neighbouring
    positions and seeds get unrelated generator states."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) % 2**64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % 2**64
    return z ^ (z >> 31)
