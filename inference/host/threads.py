"""How many threads the next step gets: the count whose steps measured faster lately.

Why: a step's matrix work is split over the threads. On a quiet PC two threads are faster
than one; beside busy programs the answer depends on the step (the native step's threads
take each other's work, docs/native.md; torch's meet after every op) and on the load, so
it is measured, not guessed: now and then a few steps run on the other count (a probe), and
their forward times are compared with the current count's recent ones for steps of the same
size. The faster count serves until the next probe. Probes that confirm the count come less
and less often (a probe's steps may be slower: on a quiet PC they are rare), one that
changes it brings the next one soon.

Steps of LARGE_ROWS rows and more (a prompt's chunks) are not measured against each other:
their products keep every thread busy, so they run on every thread, and the step after one
does too (a prompt comes in several chunks). A probe ends at such a step. Before, a probe
that began as a long prompt arrived ran its whole prefill on one thread, and one thread
chosen from decode steps beside a busy program served a whole prefill too: a 1,300-token
prompt on the Qwen2.5-1.5B shape waited 29.0 s in one round; with this rule 16.6-18.3 s in
four (`python -m bench --versus-server --model qwen-shape-1.5b --rounds 2`, 2026-12-03, 2-core
Xeon VM, alone).

While a request waits for its first token (its prompt's steps, and any step beside them),
no step is a probe's: they run on the serving count (on every thread after a chunk of
LARGE_ROWS), and a probe they interrupt starts again after them. A person waiting
for an answer to begin should not wait for a measurement (on a quiet PC a probe's steps are
the slower ones); single slow exchanges of a conversation (54 ms where their neighbours took
35-40, the embedded model) were a reason to suspect probes, not measured to be them.

The count changes between steps only, and only where the answer cannot change with it
(THREAD_INVARIANT).
"""

from __future__ import annotations

import logging
import statistics
import time
from collections import deque
from collections.abc import Callable

log = logging.getLogger("deskchat.threads")

# Waits are in seconds of forwards (time spent stepping), so an idle server does not probe
# at the first step of the next request.
PROBE_S = 2.0  # first wait before a probe, and after a probe that changed the count
MAX_PROBE_S = 32.0  # the wait doubles after each probe that kept the count, up to this
PROBE_STEPS = 6  # steps a probe runs on the other count; the first is not counted (wake-up)
RECENT = 8  # the current count's latest steps of a size that a probe is compared with ...
RECENT_S = 20.0  # ... if they are no older than this (wall time): the load changes
BETTER_BY = 0.9  # the other count must be this much faster (its median time, as a ratio)
LARGE_ROWS = 64  # steps this big run on every thread, unprobed (a prompt's chunks)

# Quantizations whose forward gives the same bits on one thread or several: their GEMMs are
# integer (exact) and the float ops around them split no sums by thread
# (tests/inference/host/test_threads.py compares the logits). Float weights (none) and int4 (bf16
# activations, float accumulation) do split them: with those the count stays fixed, since a
# near-tie could otherwise change an answer when the count changes.
THREAD_INVARIANT = frozenset({"int8", "int8-row", "int4-row"})

Forward = tuple[int, float]  # a step's forward: (rows, seconds)


def size_class(rows: int) -> int:
    """Steps compared with each other: rows within a power of two (a decoding stream with
    more or fewer drafted tokens, a prompt chunk)."""
    return rows.bit_length()


class ThreadGovernor:
    """Call `tick(last)` in the inference thread before each step, with the forward the last
    step ran (or None): it sets the thread count through `set_threads` (the engine's:
    the native step's pool, or torch's own count in the calling thread; torch's by
    default)."""

    def __init__(
        self,
        most: int,
        set_threads: Callable[[int], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.most = most
        self.threads = most
        self.changes = 0  # how often the serving count changed (metrics)
        if set_threads is None:
            import torch  # here, not at import: server.py imports this before torch is needed

            set_threads = torch.set_num_threads
        self._set_threads = set_threads
        self._clock = clock
        self._wait_s = PROBE_S
        self._stepped = 0.0  # seconds of forwards since the last decision
        self._probing: list[Forward] | None = None  # a probe's steps so far, while one runs
        # (threads, size class) -> the latest (when, seconds) of its steps
        self._recent: dict[tuple[int, int], deque[tuple[float, float]]] = {}
        self._running = most  # the count the next step runs on (a probe's or the serving one)
        self._first_token = False  # whether the step now running gives a first token

    def tick(self, last: Forward | None, first_token: bool = False) -> None:
        """`first_token`: a request running in the next step has no token yet."""
        if last is None:
            return
        now = self._clock()
        rows, seconds = last
        self._stepped += seconds
        key = (self._running, size_class(rows))
        self._recent.setdefault(key, deque(maxlen=RECENT)).append((now, seconds))
        after_first, self._first_token = self._first_token, first_token
        if rows >= LARGE_ROWS:  # a prompt's chunk: the next is likely another, on every thread
            self._probing = None
            self._run_on(self.most)
            return
        if self._probing is not None:
            if after_first:  # the probe begins again: its next step is a wake-up
                self._probing = []
            else:
                self._probing.append(last)
                if len(self._probing) >= PROBE_STEPS:
                    self._decide(now)
        elif self._stepped >= self._wait_s:
            self._probing = []
        if self._probing is None or first_token:
            self._run_on(self.threads)  # after a prompt's chunks too, the serving count
        else:
            self._run_on(1 if self.threads == self.most else self.most)

    def _decide(self, now: float) -> None:
        """After a probe: the probe's count serves if its steps were faster than the serving
        count's recent steps of the same size, by BETTER_BY."""
        other, probe = self._running, self._probing[1:]
        self._probing = None
        size = statistics.mode(size_class(rows) for rows, _s in probe)
        theirs = [s for rows, s in probe if size_class(rows) == size]
        recent = self._recent.get((self.threads, size), ())
        ours = [s for when, s in recent if now - when <= RECENT_S]
        faster = bool(ours) and statistics.median(theirs) < BETTER_BY * statistics.median(ours)
        if faster:
            log.info(
                "inference threads %d -> %d (steps of %d+ rows: %.1f ms against %.1f ms)",
                self.threads,
                other,
                1 << (size - 1),
                1000 * statistics.median(theirs),
                1000 * statistics.median(ours),
            )
            self.threads = other
            self.changes += 1
            self._wait_s = PROBE_S
        else:
            self._wait_s = min(2 * self._wait_s, MAX_PROBE_S) if ours else PROBE_S
        self._stepped = 0.0

    def _run_on(self, threads: int) -> None:
        if threads != self._running:
            self._running = threads
            self._set_threads(threads)


def governor_for(
    policy: str, quantize: str, threads: int, set_threads: Callable[[int], None] | None = None
) -> ThreadGovernor | None:
    """The governor for --thread-policy, or None for a fixed count (asked for, or forced:
    one INFO line says why). `set_threads`: what takes a new count (the engine's)."""
    if policy != "adaptive" or threads <= 1:
        return None
    if quantize not in THREAD_INVARIANT:
        why = f"quantize={quantize} changes in the last bits with the thread count"
        log.info("--thread-policy adaptive: kept at %d threads (%s)", threads, why)
        return None
    log.info("inference threads: adaptive, 1 or %d, whichever measures faster", threads)
    return ThreadGovernor(threads, set_threads)
