"""The one inference thread and its bounded FIFO.

`submit()` never blocks: a full queue is an immediate Overloaded. The thread takes jobs in
order, drops those whose client left or whose deadline passed, runs the engine, and ends every
job with exactly one terminal item on the job's reply queue. An exception inside the engine
becomes that job's Internal error; the thread goes on serving.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Protocol

from inference.errors import (
    Cancelled,
    Internal,
    Overloaded,
    ServiceError,
    Timeout,
    Unavailable,
)
from inference.jobs import Delta, Done, Failed, Generation, Job, Sampling, Usage

log = logging.getLogger("deskchat.worker")

IDLE_TICK_S = 1.0  # an idle thread still beats this often, for the watchdog


class EngineLike(Protocol):
    name: str

    def run(self, prompt_ids, sampling: Sampling, emit, should_stop) -> Generation: ...


class Worker:
    """Owns the engine and the only thread that may call it: start(), submit(job), stop()."""

    def __init__(self, engine: EngineLike | None, max_queue: int):
        self.engine = engine  # None until start(load) has built it in the thread
        self.capacity = max_queue
        self._queue: queue.Queue[Job | None] = queue.Queue(maxsize=max_queue)
        self._thread = threading.Thread(target=self._loop, name="inference", daemon=True)
        self._stopping = threading.Event()
        self._current: Job | None = None
        self._job_seconds = 5.0  # running estimate of a job's time, for Retry-After
        self.heartbeat = time.monotonic()  # last sign of progress: a token, or an idle tick
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
        """Refuse new jobs, end the waiting and the running one with 503, join the thread."""
        self._stopping.set()
        self._drain()
        with contextlib.suppress(queue.Full):
            self._queue.put_nowait(None)  # wake the thread if it waits for work
        if self._thread.ident is not None:  # started
            self._thread.join(timeout)
        self._drain()  # anything submitted while the thread was finishing

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def depth(self) -> int:
        """Jobs waiting in the FIFO (not counting the one running)."""
        return self._queue.qsize()

    @property
    def busy(self) -> bool:
        return self._current is not None

    # -- the HTTP side ----------------------------------------------------------------------

    def check_room(self) -> None:
        """Raise what submit() would for a full queue or a stopped worker, without a job."""
        if self._stopping.is_set() or not self.alive:
            raise Unavailable("the server is stopping or its inference thread is gone")
        if self._queue.full():
            raise self._overloaded()

    def submit(self, job: Job) -> Job:
        self.check_room()
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            raise self._overloaded() from None
        return job

    def _overloaded(self) -> Overloaded:
        # A fair guess of when a slot frees up: the job-time estimate, at least one second.
        return Overloaded(
            f"the queue is full ({self.capacity} waiting); retry later",
            retry_after_s=self._job_seconds,
        )

    def run_now(self, prompt_ids: list[int], sampling: Sampling) -> Done:
        """Run one generation in the worker thread and wait for it (used for warm-up)."""
        job = self.submit(Job(prompt_ids, sampling, timeout_s=600))
        while True:
            event = job.events.get(timeout=600)
            if isinstance(event, Failed):
                raise event.error
            if isinstance(event, Done):
                return event

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
        while not self._stopping.is_set():
            self.heartbeat = time.monotonic()
            try:
                job = self._queue.get(timeout=IDLE_TICK_S)
            except queue.Empty:
                continue
            if job is None:  # stop()'s wake-up call
                continue
            self._current = job
            try:
                outcome = self._serve(job)
            except BaseException:  # the thread is going down: its job still gets its end
                job.events.put(Failed(Internal(f"the inference thread died (request {job.id})")))
                raise
            finally:
                self._current = None
            job.events.put(outcome)

    def _should_stop(self, job: Job) -> bool:
        self.heartbeat = time.monotonic()
        return job.cancelled or job.expired() or self._stopping.is_set()

    def _serve(self, job: Job) -> Done | Failed:
        picked = time.monotonic()
        job.started = True
        queued_ms = (picked - job.created) * 1000
        if self._stopping.is_set():
            return Failed(Unavailable("the server is stopping"))
        if job.cancelled:
            self._count_cancelled(job, "queued")
            return Failed(Cancelled("the client went away while queued"))
        if job.expired():
            return Failed(
                Timeout(
                    f"the request waited {queued_ms:.0f} ms in the queue and "
                    f"passed its {job.timeout_s:g} s deadline"
                )
            )
        try:
            result = self.engine.run(
                job.prompt_ids,
                job.sampling,
                lambda text: job.events.put(Delta(text)),
                lambda: self._should_stop(job),
            )
        except ServiceError as exc:
            return Failed(exc)
        except Exception:
            log.exception("generation failed for %s", job.id)
            return Failed(Internal(f"generation failed (request {job.id}); see the server log"))
        done_at = time.monotonic()
        if result.finish_reason == "interrupted":
            return Failed(self._interruption(job, result))
        self._job_seconds = 0.8 * self._job_seconds + 0.2 * (done_at - picked)
        gen_s = done_at - picked
        return Done(
            finish_reason=result.finish_reason,
            usage=Usage(len(job.prompt_ids), result.completion_tokens),
            queued_ms=queued_ms,
            ttft_ms=result.ttft_s * 1000,
            total_ms=(done_at - job.created) * 1000,
            tokens_per_second=result.completion_tokens / gen_s if gen_s > 0 else 0.0,
        )

    def _count_cancelled(self, job: Job, stage: str) -> None:
        """A job whose client left; not one its handler gave up on at the deadline (a timeout)."""
        if not job.expired():
            self.cancellations[stage] += 1

    def _interruption(self, job: Job, result: Generation) -> ServiceError:
        if self._stopping.is_set():
            return Unavailable("the server is stopping")
        if job.cancelled:
            self._count_cancelled(job, "running")
            return Cancelled("the client went away")
        return Timeout(
            f"the request passed its {job.timeout_s:g} s deadline after "
            f"{result.completion_tokens} tokens"
        )

    def _drain(self) -> None:
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                job.events.put(Failed(Unavailable("the server is stopping")))
