"""A request's first step at real-time priority (--realtime-first-step-ms): the inference
threads at SCHED_FIFO 1 for the step that gives a waiting request its first token, back to
their own policy, nice and slice right after.

Why: beside busy programs a fair thread that loses its CPU gets it back at the busy one's
next scheduler event, up to a tick later (4 ms at 250 Hz), and a step's threads wait for
each other, so the first token's tail beside two busy processes was 2-3x the quiet median.
At SCHED_FIFO the step's threads take their CPUs from any fair thread at once. Only the
first step: while later steps run, the client reading the answer and the HTTP threads
need a CPU too (with every server thread real-time they starved: gaps of half a second),
and during a first step nothing is ready to be read yet (docs/latency.md).

The bound: only a step expected (at the engine's measured rates) to take at most the
setting's milliseconds is raised, so a long prompt never holds the CPUs from the PC's other
programs for seconds; the kernel's own guard (sched_rt_runtime_us; the fair server since
Linux 6.12) stays the backstop. The permission: root, or LimitRTPRIO=1 with
RestrictRealtime=no in the unit (the dedicated-pc profile); refused, one WARNING and off.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from inference.host.process import (
    FAIR_POLICIES,
    INFERENCE_THREAD_NAME,
    SCHED_FLAG_RESET_ON_FORK,
    SchedAttr,
    sched_attr,
    set_sched_attr,
)

log = logging.getLogger("deskchat.host")

PRIORITY = 1  # the lowest real-time priority: above every fair thread, below the kernel's
_TASKS = "/proc/self/task"


class RealtimeFirstStep:
    """`fits(expected_s)` says whether a first step may run raised; `with raised():` runs it
    so. Called in the inference thread only."""

    def __init__(self, most_ms: int, slice_us: int):
        self.most_s = most_ms / 1000
        self.on = most_ms > 0
        self.slice_ns = slice_us * 1000  # the slice the threads run with (--sched-slice-us)
        self._inference: dict[str, bool] = {}  # thread id -> whether it is an inference thread
        self.steps = 0  # steps run raised (the metrics' deskchat_realtime_first_steps)

    def fits(self, expected_s: float | None) -> bool:
        """A step expected to take `expected_s` (None: not known) may run raised."""
        return expected_s is not None and expected_s <= self.most_s

    @contextmanager
    def raised(self) -> Iterator[None]:
        """The inference threads at SCHED_FIFO 1 inside, back to what they were after, even
        when the step raises."""
        saved, present = self._raise()
        self.steps += bool(saved)
        try:
            yield
        finally:
            self._lower(saved, present)

    def check(self) -> None:
        """Raise and lower once at the start (the calling thread: the pool starts at the
        first forward), so a refusal is logged before any request. Not counted as a step."""
        if not self.on:
            return
        self._lower(*self._raise())
        if self.on:
            log.info(
                "a request's first step runs real-time (SCHED_FIFO %d) when expected to take "
                "at most %g ms",
                PRIORITY,
                self.most_s * 1000,
            )

    def threads(self, tids: list[str] | None = None) -> list[int]:
        """The process's inference threads (the thread named INFERENCE_THREAD_NAME and the
        pools it started, which inherit its name), by thread id; `tids`: the process's
        thread ids, if just listed. A name is read once per thread."""
        tids = os.listdir(_TASKS) if tids is None else tids
        known = self._inference
        self._inference = {
            tid: known[tid] if tid in known else _comm(tid) == INFERENCE_THREAD_NAME for tid in tids
        }
        return [int(tid) for tid, inference in self._inference.items() if inference]

    def _raise(self) -> tuple[dict[int, SchedAttr], set[str]]:
        """Each fair inference thread to SCHED_FIFO: what each was, to lower it again, and
        every thread id there was before (a thread not among them was born raised). A thread
        already real-time (or SCHED_IDLE) is the operator's choice: left as it is."""
        listed = os.listdir(_TASKS)
        present = set(listed)
        saved: dict[int, SchedAttr] = {}
        try:
            for tid in self.threads(listed):
                was = sched_attr(tid)
                if isinstance(was, str) or was.policy not in FAIR_POLICIES:
                    continue  # ended meanwhile, or not a fair thread
                raised = SchedAttr(os.SCHED_FIFO, was.flags, 0, PRIORITY, 0)
                problem = set_sched_attr(tid, raised)
                if problem:
                    self._refused(problem)
                    self._lower(saved, present)
                    return {}, present
                saved[tid] = was
        except BaseException:
            self._lower(saved, present)
            raise
        return saved, present

    def _lower(self, saved: dict[int, SchedAttr], present: set[str]) -> None:
        """Back to each thread's policy and nice (which the kernel kept while it was
        real-time, so no privilege is needed) and the server's slice; the calling thread
        last, so that it is not preempted while others are still real-time. A thread born
        during the step (a pool growing), whatever its name, inherited the raised policy:
        it gets the calling thread's, which it would have inherited otherwise."""
        if not saved:
            return
        me = threading.get_native_id()
        mine = saved.get(me) or next(iter(saved.values()))
        born = [int(tid) for tid in os.listdir(_TASKS) if tid not in present]
        for tid in [*born, *sorted(saved, key=lambda tid: tid == me)]:
            if tid not in saved:
                now = sched_attr(tid)
                if isinstance(now, str) or (now.policy, now.priority) != (os.SCHED_FIFO, PRIORITY):
                    continue  # ended, or not born raised
            self._back(tid, saved.get(tid, mine))

    def _back(self, tid: int, was: SchedAttr) -> None:
        problem = set_sched_attr(tid, SchedAttr(was.policy, was.flags, was.nice, 0, self.slice_ns))
        if problem is None or not os.path.exists(f"{_TASKS}/{tid}"):
            return  # back, or it ended meanwhile
        # Not expected. A thread left real-time is the worst outcome: plain SCHED_OTHER
        # (nice and slice lost) rather than that, and the setting off.
        flags = os.SCHED_RESET_ON_FORK if was.flags & SCHED_FLAG_RESET_ON_FORK else 0
        with contextlib.suppress(OSError):
            os.sched_setscheduler(tid, os.SCHED_OTHER | flags, os.sched_param(0))
        self.on = False
        log.error("inference thread %d: cannot lower it from real-time as it was: %s", tid, problem)

    def _refused(self, problem: str) -> None:
        self.on = False
        log.warning(
            "--realtime-first-step-ms: off: %s for SCHED_FIFO %d; the unit needs "
            "LimitRTPRIO=1 and RestrictRealtime=no (the dedicated-pc profile sets both), "
            "or run the server as root; a kernel with real-time group scheduling also needs "
            "real-time time for its cgroup",
            problem,
            PRIORITY,
        )


def _comm(tid: str) -> str | None:
    try:
        with open(f"{_TASKS}/{tid}/comm") as comm:
            return comm.read().strip()
    except OSError:  # it ended meanwhile
        return None
