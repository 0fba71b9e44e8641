"""How many OpenMP threads the next step gets: all of them, or one while others want the CPUs.

Why: a step's matrix work is split over the OpenMP threads, which meet after every op; when
other programs keep the CPUs busy, one of them is often descheduled and the whole token waits
for it (docs/latency.md, has the measured cost, and what one thread saves). So
before a step the inference thread looks, at most once a second, at how long each of its
threads waited for a CPU (the run-queue delay the kernel keeps per thread in
/proc/self/task/TID/schedstat): if any waited a large share of the span, the next steps run
on one thread; after a few quiet seconds they get all of them again, probing less and less
often while the contention lasts.

The count changes between steps only, and only where the answer cannot change with it
(THREAD_INVARIANT).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

from inference.host.process import INFERENCE_THREAD_NAME

log = logging.getLogger("deskchat.threads")

INTERVAL_S = 1.0  # the shortest span a look judges
DOWN_AT = 0.25  # share of its time one inference thread waited for a CPU: contention
UP_BELOW = 0.05  # ... every thread below this: quiet
PROBE_S = 4.0  # quiet this long on one thread before all threads are tried again
MAX_PROBE_S = 64.0  # the wait doubles each time a try meets contention at once, up to this
AWAKE = 0.5  # a span in which the threads ran or waited less than this share slept: not judged

# Quantizations whose forward gives the same bits on one thread or several: their GEMMs are
# integer (exact) and the float ops around them split no sums by thread
# (tests/inference/host/test_threads.py compares the logits). Float weights (none) and int4 (bf16
# activations, float accumulation) do split them: with those the count stays fixed, since a
# near-tie could otherwise change an answer when the count changes.
THREAD_INVARIANT = frozenset({"int8", "int8-row", "int4-row"})

Sample = dict[int, tuple[int, int]]  # thread id -> (ns running, ns waiting for a CPU)


def thread_waits(name: str = INFERENCE_THREAD_NAME, tasks: str = "/proc/self/task") -> Sample:
    """Each thread called `name` (the inference thread and the OpenMP threads it started,
    which inherit its name): its time running and its time runnable but waiting for a CPU."""
    found: Sample = {}
    with os.scandir(tasks) as entries:
        for task in entries:
            try:
                with open(os.path.join(task.path, "comm")) as comm:
                    if comm.read().strip() != name:
                        continue
                with open(os.path.join(task.path, "schedstat")) as stat:
                    ran, waited = stat.read().split()[:2]
                found[int(task.name)] = (int(ran), int(waited))
            except (OSError, ValueError):  # the thread ended meanwhile
                continue
    return found


def schedstat_readable() -> bool:
    """False in a kernel without per-thread schedstat (no CONFIG_SCHED_INFO)."""
    return os.path.exists("/proc/thread-self/schedstat")


class ThreadGovernor:
    """Call `tick()` in the inference thread before each step: it sets torch's thread count
    (which is the calling thread's own OpenMP setting)."""

    def __init__(
        self,
        most: int,
        set_threads: Callable[[int], None] | None = None,
        sample: Callable[[], Sample] = thread_waits,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.most = most
        self.threads = most
        self.changes = 0  # how often the count changed (metrics)
        if set_threads is None:
            import torch  # here, not at import: server.py imports this before torch is needed

            set_threads = torch.set_num_threads
        self._set_threads = set_threads
        self._sample = sample
        self._clock = clock
        self._last: tuple[float, Sample] | None = None
        self._quiet_since: float | None = None
        self._probe_s = PROBE_S
        self._probing = False  # all threads were just tried again: the next look tells

    def tick(self) -> None:
        """Look at the threads' waiting since the last look, if a whole interval has passed."""
        now = self._clock()
        if self._last is not None and now - self._last[0] < INTERVAL_S:
            return
        try:
            sample = self._sample()
        except OSError:  # e.g. out of file descriptors: skip this look, not the step
            return
        last, self._last = self._last, (now, sample)
        if last is None:
            return
        span_ns = (now - last[0]) * 1e9
        shares, awake = [], 0.0
        for tid, (ran, waited) in sample.items():
            if tid not in last[1]:
                continue  # new since the last look (or missed then): its past is not this span
            ran0, waited0 = last[1][tid]
            busy = (ran - ran0) + (waited - waited0)
            if busy > 0:
                shares.append((waited - waited0) / busy)
                awake = max(awake, busy / span_ns)
        if awake < AWAKE:
            # Mostly asleep (no job ran): this span says nothing about the others' load,
            # and it is not quiet time either.
            self._quiet_since = None
            return
        self._judge(max(shares), last[0], now)

    def _judge(self, share: float, since: float, now: float) -> None:
        """Two states. At `most` threads: the most-waiting thread at DOWN_AT or more -> one
        thread, and if that came at the first look after a try, the next try waits twice as
        long. At one thread: every thread under UP_BELOW since `_quiet_since` for the current
        probe time -> `most` again."""
        probing, self._probing = self._probing, False
        if self.threads == self.most:
            if share >= DOWN_AT:
                self._probe_s = min(2 * self._probe_s, MAX_PROBE_S) if probing else PROBE_S
                self._quiet_since = None
                self._set(1, share, now - since)
            return
        if share >= UP_BELOW:
            self._quiet_since = None
            return
        if self._quiet_since is None:
            self._quiet_since = since
        if now - self._quiet_since >= self._probe_s:
            self._probing = True
            self._set(self.most, share, now - since)

    def _set(self, threads: int, share: float, span_s: float) -> None:
        log.info(
            "inference threads %d -> %d (the most a thread waited for a CPU: %.0f%% of the "
            "last %.1f s)",
            self.threads,
            threads,
            100 * share,
            span_s,
        )
        self.threads = threads
        self.changes += 1
        self._set_threads(threads)


def governor_for(policy: str, quantize: str, threads: int) -> ThreadGovernor | None:
    """The governor for --thread-policy, or None for a fixed count (asked for, or forced:
    one INFO line says why)."""
    if policy != "adaptive" or threads <= 1:
        return None
    why = None
    if quantize not in THREAD_INVARIANT:
        why = f"quantize={quantize} changes in the last bits with the thread count"
    elif not schedstat_readable():
        why = "this kernel keeps no per-thread schedstat"
    if why:
        log.info("--thread-policy adaptive: kept at %d threads (%s)", threads, why)
        return None
    log.info("inference threads: adaptive, %d, or 1 while others keep the CPUs busy", threads)
    return ThreadGovernor(threads)
