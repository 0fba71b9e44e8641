"""How many OpenMP threads the next step gets: all of them, or one while others want the CPUs.

Why: a step's matrix work is split over the OpenMP threads, which meet after every op; when
other programs keep the CPUs busy, one of them is often descheduled and the whole token waits
for it. Measured on 2 CPUs (README, "Steady latency"): with two busy programs beside the
server, two threads gave 3-4x longer inter-token gaps than one, while on a quiet PC two were
1.4-1.9x faster. So before a step the inference thread looks, at most once a second, at how
long its threads waited for a CPU (the run-queue delay the kernel keeps per thread in
/proc/self/task/TID/schedstat): a large share means contention, and the next steps run on one
thread; after a few quiet seconds they get all of them again, probing less and less often
while the contention lasts.

The count changes between steps only, and with int8 or int4 weights the answer does not
depend on it: the integer GEMMs are exact and the float ops around them give the same bits on
one thread or more (tests/test_threads.py compares logits, and a greedy answer with the count
switched at every step). Float weights do not: see THREAD_INVARIANT.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

from inference.host import INFERENCE_THREAD_NAME

log = logging.getLogger("deskchat.threads")

INTERVAL_S = 1.0  # the shortest span a decision looks at
DOWN_AT = 0.25  # share of their time the inference threads waited for a CPU: contention
UP_BELOW = 0.05  # ... and below this, quiet
PROBE_S = 4.0  # quiet this long on one thread before all threads are tried again
MAX_PROBE_S = 64.0  # the wait doubles each time a try meets contention at once, up to this

# Quantizations whose forward gives the same bits on one thread or several (the integer
# GEMMs are exact; tests/test_threads.py compares logits). Float GEMMs (quantize none) split
# their sums by thread: logits differ in the last bits (5e-5 on SmolLM2), so a near-tie
# could change an answer when the count changes; those keep a fixed count.
THREAD_INVARIANT = frozenset({"int8", "int8-row", "int4"})


def thread_waits(name: str = INFERENCE_THREAD_NAME, tasks: str = "/proc/self/task") -> tuple:
    """(ns running, ns runnable but waiting for a CPU), summed over this process's threads
    called `name` (the inference thread and the OpenMP threads it started)."""
    ran = waited = 0
    for task in os.scandir(tasks):
        try:
            with open(os.path.join(task.path, "comm")) as comm:
                if comm.read().strip() != name:
                    continue
            with open(os.path.join(task.path, "schedstat")) as stat:
                fields = stat.read().split()
            ran += int(fields[0])
            waited += int(fields[1])
        except (OSError, ValueError, IndexError):  # the thread ended meanwhile; no schedstat
            continue
    return ran, waited


class ThreadGovernor:
    """Call `tick()` in the inference thread before each step; it sets torch's thread count."""

    def __init__(
        self,
        most: int,
        set_threads: Callable[[int], None] | None = None,
        sample: Callable[[], tuple] = thread_waits,
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
        self._last: tuple[float, int, int] | None = None  # (when, ran, waited)
        self._quiet_since: float | None = None
        self._probe_s = PROBE_S
        self._raised_at: float | None = None

    def tick(self) -> None:
        if self.most <= 1:
            return
        now = self._clock()
        if self._last is not None and now - self._last[0] < INTERVAL_S:
            return
        ran, waited = self._sample()
        last, self._last = self._last, (now, ran, waited)
        if last is None:
            return
        busy = (ran - last[1]) + (waited - last[2])
        if busy <= 0:
            return  # the threads slept the whole time: nothing to judge
        self._judge((waited - last[2]) / busy, now)

    def _judge(self, share: float, now: float) -> None:
        if self.threads == self.most:
            if share >= DOWN_AT:
                # Contention again right after a try: wait longer before the next one.
                soon = self._raised_at is not None and now - self._raised_at <= 2 * INTERVAL_S
                self._probe_s = min(2 * self._probe_s, MAX_PROBE_S) if soon else PROBE_S
                self._quiet_since = None
                self._set(1, share)
            return
        if share >= UP_BELOW:
            self._quiet_since = None
        elif self._quiet_since is None:
            self._quiet_since = now
        elif now - self._quiet_since >= self._probe_s:
            self._raised_at = now
            self._set(self.most, share)

    def _set(self, threads: int, share: float) -> None:
        log.info(
            "inference threads %d -> %d (they waited for a CPU %.0f%% of the last %.0f s)",
            self.threads,
            threads,
            100 * share,
            INTERVAL_S,
        )
        self.threads = threads
        self.changes += 1
        self._set_threads(threads)


def governor_for(policy: str, quantize: str, threads: int) -> ThreadGovernor | None:
    """The governor for --thread-policy, or None for a fixed count (asked for, or forced by
    float weights, which one INFO line says)."""
    if policy != "adaptive" or threads <= 1:
        return None
    if quantize not in THREAD_INVARIANT:
        log.info(
            "--thread-policy adaptive: kept at %d threads with quantize=%s (float sums "
            "change with the thread count, and so could an answer)",
            threads,
            quantize,
        )
        return None
    return ThreadGovernor(threads)
