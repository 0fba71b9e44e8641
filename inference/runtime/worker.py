"""The one inference thread, its bounded FIFO and the batch of jobs it runs.

`submit()` never blocks: a full queue is an immediate Overloaded. Slots belong to live jobs:
a waiting job whose client left or whose deadline passed is taken out of the FIFO (and ended)
whenever anyone looks at the queue, so it never counts against `--max-queue` nor in `depth`.

The thread admits jobs in FIFO order while fewer than `max_batch` run and their KV caches
fit in the memory budget, then steps all running jobs together (the batch and how each of
its jobs ends: runtime/batch.py). Between steps each job's cancel flag and deadline are
read: a job that finishes, is cancelled or times out leaves the batch at once, the others go
on. Every job ends with exactly one terminal item on its reply queue.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from contextlib import nullcontext

from inference.host.process import between_jobs  # latency: GC between jobs
from inference.host.realtime import RealtimeFirstStep
from inference.runtime.batch import Batch, EngineLike, Running, own_failure
from inference.runtime.jobs import Done, Failed, Job, Sampling
from service.errors import Cancelled, Internal, Overloaded, ServiceError, Timeout, Unavailable

log = logging.getLogger("deskchat.worker")

IDLE_TICK_S = 1.0  # an idle thread still beats at least this often, for the watchdog
# After this long with nothing running or waiting, the engine lets go of what it keeps for
# the next job (Engine.idle: finished jobs' cache buffers). Longer than a person takes to
# read an answer and ask the next question, so a conversation keeps them; a PC left alone
# gets its memory back within the minute.
IDLE_RELEASE_S = 60.0


class Worker:
    """Owns the engine and the only thread that may call it: start(), submit(job), stop()."""

    def __init__(
        self,
        engine: EngineLike | None,
        max_queue: int,
        max_batch: int = 1,
        batch_memory: int | None = None,
        pace: Callable[[tuple[int, float] | None, bool], None] | None = None,
        realtime: RealtimeFirstStep | None = None,
    ):
        self.engine = engine  # None until start(load) has built it in the thread
        self.capacity = max_queue
        self.max_batch = max_batch
        self.batch_memory = batch_memory  # bytes of KV cache for all running jobs; None: any
        # Called in the thread before each step with the engine's last forward and whether
        # the step gives a job its first token (inference/host/threads.py: the thread count).
        self.pace = pace
        # Raises the inference threads to real-time for a short first step (host/realtime.py).
        self.realtime = realtime
        # The FIFO of waiting jobs. One lock guards it and the batch: a job is either
        # waiting, or running, or ended, and moves between them only under the lock.
        self._waiting: deque[Job] = deque()
        self._lock = threading.Condition()
        self._thread = threading.Thread(target=self._loop, name="inference", daemon=True)
        self._stopping = threading.Event()
        self._batch = Batch(self._lock)  # the running jobs
        self.heartbeat = time.monotonic()  # last sign of progress: a step, or an idle tick
        self.idle_tick = IDLE_TICK_S  # the watchdog shortens it below its own period
        self.idle_release_s = IDLE_RELEASE_S
        self._load: Callable[[], EngineLike] | None = None
        self._loaded = threading.Event()
        self._load_error: BaseException | None = None
        # Jobs ended because their client left, by where: read by the metrics.
        self.cancellations = {"queued": 0, "running": 0}

    # -- control ----------------------------------------------------------------------------

    def start(self, load: Callable[[], EngineLike] | None = None) -> Worker:
        """Start the thread. With `load`, the thread first builds its engine itself and
        start() waits for that, raising what it raised: the model's CPU kernels run about
        twice as fast in the thread that loaded it (measured on SmolLM2 int8: 87 tok/s
        against 35-44 when loaded in the main thread and run here)."""
        self._load = load
        self._thread.start()
        if load is not None:
            self._loaded.wait()
            if self._load_error is not None:
                raise self._load_error
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Refuse new jobs, end the waiting and the running ones with 503, join the thread."""
        self._stopping.set()
        self._end_waiting("the server is stopping")  # also wakes the thread if it waits
        if self._thread.ident is not None:  # started
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def depth(self) -> int:
        """Live jobs waiting in the FIFO (not counting the running ones)."""
        with self._lock:
            self._prune()
            return len(self._waiting)

    @property
    def running(self) -> int:
        return len(self._batch.entries)

    @property
    def busy(self) -> bool:
        return bool(self._batch.entries)

    # -- the HTTP side ----------------------------------------------------------------------

    def check_room(self) -> None:
        """Raise what submit() would for a full queue or a stopped worker, without a job."""
        with self._lock:
            self._check_room()

    def submit(self, job: Job) -> Job:
        with self._lock:
            self._check_room()
            self._waiting.append(job)
            self._lock.notify()
        return job

    def _check_room(self) -> None:  # with the lock held
        if self._stopping.is_set() or not self.alive:
            raise Unavailable("the server is stopping or its inference thread is gone")
        self._prune()
        if len(self._waiting) >= self.capacity:
            raise Overloaded(
                f"the queue is full ({self.capacity} waiting); retry later",
                retry_after_s=self._batch.expected_start_s(0, self.max_batch),
            )

    def expected_start_s(self, position: int) -> float:
        """Expected seconds until the job waiting at `position` (0: the head) starts. For
        position 0 it is when a waiting slot frees."""
        with self._lock:
            return self._batch.expected_start_s(position, self.max_batch)

    def expected_prefill_s(self, prompt_tokens: int) -> float:
        """Expected seconds of prefill (to the first token) for a prompt of that many tokens,
        at the measured rate."""
        return self._batch.expected_prefill_s(prompt_tokens)

    @property
    def measured(self) -> bool:
        """True once a job has been timed: the estimates are measurements, not guesses."""
        return self._batch.measured

    def run_now(self, prompt_ids: list[int], sampling: Sampling) -> Done:
        """Run one generation in the worker thread and wait for it (used for warm-up).
        `sampling.max_tokens` is its budget, decided by inference/runtime/budget.py."""
        job = self.submit(Job(prompt_ids, sampling, timeout_s=600))
        while True:
            event = job.events.get(timeout=600)
            if isinstance(event, Failed):
                raise event.error
            if isinstance(event, Done):
                return event

    # -- the FIFO ---------------------------------------------------------------------------

    def _prune(self) -> None:
        """End and take out the waiting jobs nobody waits for: client gone, deadline passed.
        Called with the lock held, wherever the queue is looked at, so their slots are free
        the moment anyone could want one."""
        if not any(job.cancelled or job.expired() for job in self._waiting):
            return
        live: deque[Job] = deque()
        for job in self._waiting:
            if job.cancelled:
                self._count_cancelled(job, "queued")
                job.events.put(Failed(Cancelled("the client went away while queued")))
            elif job.expired():
                job.events.put(Failed(self._expired_in_queue(job)))
            else:
                live.append(job)
        self._waiting = live

    @staticmethod
    def _expired_in_queue(job: Job) -> Timeout:
        waited_ms = (time.monotonic() - job.created) * 1000
        return Timeout(
            f"the request waited {waited_ms:.0f} ms in the queue and "
            f"passed its {job.timeout_s:g} s deadline"
        )

    def _reservation(self, job: Job) -> int:
        return self.engine.cache_bytes(len(job.prompt_ids), job.sampling.max_tokens)

    def _take_next(self) -> tuple[Job, int] | None:
        """The head of the FIFO and its reservation, if it may join the batch now: a free
        place, and its cache fits beside the running jobs' (a job alone always fits). The
        head waits otherwise; nobody behind it overtakes."""
        with self._lock:
            self._prune()
            if not self._waiting or self._stopping.is_set():
                return None
            running = self._batch.entries
            if len(running) >= self.max_batch:
                return None
            need = self._reservation(self._waiting[0])
            held = sum(r.reserved for r in running)
            if running and self.batch_memory is not None and held + need > self.batch_memory:
                return None
            return self._waiting.popleft(), need

    def _wait_for_work(self) -> None:
        with self._lock:
            self._prune()
            if not self._waiting and not self._stopping.is_set():
                self._lock.wait(self.idle_tick)

    def _end_waiting(self, why: str) -> None:
        with self._lock:
            while self._waiting:
                self._waiting.popleft().events.put(Failed(Unavailable(why)))
            self._lock.notify_all()

    # -- the thread -------------------------------------------------------------------------

    def _loop(self) -> None:
        if self._load is not None:
            try:
                self.engine = self._load()
            except BaseException as exc:  # reported by start(), in the caller's thread
                self._load_error = exc
                return
            finally:
                self._loaded.set()
        self._fit_batch()
        idle_since = None  # when the batch last emptied
        try:
            while not self._stopping.is_set():
                self.heartbeat = time.monotonic()
                # latency: the oldest GC generation here, between steps: whenever
                # nothing runs or waits, else only now and then (host.between_jobs)
                between_jobs(len(self._waiting) + len(self._batch.entries))
                self._admit()
                self._leave_if_stopped()
                if not self._batch.entries:
                    idle_since = idle_since or time.monotonic()
                    if time.monotonic() - idle_since >= self.idle_release_s:
                        self.engine.idle()
                    self._wait_for_work()
                    continue
                idle_since = None
                if self.pace is not None:
                    waiting = any(e.stream.completion_tokens == 0 for e in self._batch.entries)
                    self.pace(self.engine.last_forward, waiting)
                self._step()
        except BaseException:  # the thread is going down: every job still gets its end
            self._stopping.set()  # refuse new jobs before the thread is gone for good
            for entry in list(self._batch.entries):
                why = f"the inference thread died (request {entry.job.id})"
                self._batch.end(entry, Failed(Internal(why)))
            self._end_waiting("the inference thread died")
            raise
        for entry in list(self._batch.entries):
            self._leave(entry, Unavailable("the server is stopping"))

    def _fit_batch(self) -> None:
        """One job at a time unless the engine's answers are the same alone or in a batch:
        a user must not get a different answer because someone else asked at the time.
        INFO, not WARNING: with the default --max-batch this is the expected state of a CPU
        without AVX2 or of float and int4 weights."""
        if self.max_batch > 1 and not self.engine.batch_invariant:
            log.info(
                "--max-batch %d needs batch-invariant Linears (quantize int8-row on a CPU "
                "that runs it): running one job at a time",
                self.max_batch,
            )
            self.max_batch = 1

    def _admit(self) -> None:
        """Open streams for the jobs that may join the batch now."""
        while (taken := self._take_next()) is not None:
            job, reserved = taken
            picked = time.monotonic()
            job.started = True
            try:
                stream = self.engine.open(job.prompt_ids, job.sampling)
            except ServiceError as exc:
                job.events.put(Failed(exc))
                continue
            except Exception as exc:
                job.events.put(Failed(own_failure(job, exc, "opening its generation")))
                continue
            except BaseException:  # the thread is going down: this job still gets its end
                job.events.put(Failed(Internal(f"the inference thread died (request {job.id})")))
                raise
            self._batch.join(Running(job, stream, picked, reserved))

    def _leave_if_stopped(self) -> None:
        """Take out the running jobs whose client left or whose deadline passed."""
        for entry in list(self._batch.entries):
            job = entry.job
            if job.cancelled:
                self._count_cancelled(job, "running")
                self._leave(entry, Cancelled("the client went away"))
            elif job.expired():
                self._leave(entry, self._batch.timed_out(entry))

    def _step(self) -> None:
        """One step of the batch, then its new text out. A short step that gives a request
        its first token runs with the inference threads real-time (--realtime-first-step-ms),
        its text put out before they are lowered: lowered first, the threads that had waited
        through the step took the CPUs before the text was out (a quiet TTFT p50 of 9.8 ms
        against 8.0 in one run, docs/latency.md)."""
        realtime = self.realtime
        raised = (
            realtime is not None
            and realtime.on
            and realtime.fits(self.engine.prefill_step_s([e.stream for e in self._batch.entries]))
        )
        with realtime.raised() if raised else nullcontext():
            if not self._batch.step(self.engine):
                return
            self.heartbeat = time.monotonic()
            self._batch.settle(self.engine)

    def _leave(self, entry: Running, error: ServiceError) -> None:
        self._batch.leave(self.engine, entry, error)

    def _count_cancelled(self, job: Job, stage: str) -> None:
        """A job whose client left; not one its handler gave up on at the deadline (a timeout)."""
        if not job.expired():
            self.cancellations[stage] += 1
