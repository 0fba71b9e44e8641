"""The one inference thread and its bounded FIFO.

`submit()` never blocks: a full queue is an immediate Overloaded. The thread takes jobs in
order, drops those whose client left or whose deadline passed, runs the engine, and ends every
job with exactly one terminal item on the job's reply queue. An exception inside the engine
becomes that job's Internal error; the thread goes on serving.
"""

from __future__ import annotations

import contextlib
import logging
import math
import queue
import threading
import time
from typing import Protocol

from inference.engine import Generation
from inference.errors import Cancelled, Internal, Overloaded, ServiceError, Timeout
from inference.jobs import Delta, Done, Failed, Job, Sampling, Usage

log = logging.getLogger("deskchat.worker")

_STOP = object()  # sentinel that ends the thread


class EngineLike(Protocol):
    name: str
    context_tokens: int

    def run(self, prompt_ids, sampling: Sampling, emit, should_stop) -> Generation: ...


class Worker:
    def __init__(self, engine: EngineLike, max_queue: int):
        self.engine = engine
        self.capacity = max_queue
        self._queue: queue.Queue = queue.Queue(maxsize=max_queue)
        self._thread = threading.Thread(target=self._loop, name="inference", daemon=True)
        self._current: Job | None = None
        self._job_seconds = 5.0  # running mean of job time, for Retry-After

    # -- control ----------------------------------------------------------------------------

    def start(self) -> Worker:
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel what waits and what runs, and join the thread."""
        self._drain(Cancelled("the server is shutting down"))
        current = self._current
        if current is not None:
            current.cancel()
        with contextlib.suppress(queue.Full):
            self._queue.put(_STOP, timeout=timeout)
        self._thread.join(timeout)

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

    def submit(self, job: Job) -> Job:
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            raise Overloaded(
                f"the queue is full ({self.capacity} waiting); retry later",
                retry_after_s=self.retry_after_s(),
            ) from None
        return job

    def retry_after_s(self) -> int:
        """A fair guess of when a slot frees up: the mean job time, at least one second."""
        return max(1, math.ceil(self._job_seconds))

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
        while True:
            job = self._queue.get()
            if job is _STOP:
                return
            self._current = job
            try:
                job.events.put(self._serve(job))
            finally:
                self._current = None

    def _serve(self, job: Job) -> Done | Failed:
        picked = time.monotonic()
        queued_ms = (picked - job.created) * 1000
        if job.cancelled:
            return Failed(Cancelled("the client went away while queued"))
        if job.expired():
            return Failed(Timeout(f"the request waited {queued_ms:.0f} ms in the queue and "
                                  f"passed its {job.timeout_s:g} s deadline"))
        try:
            result = self.engine.run(
                job.prompt_ids,
                job.sampling,
                lambda text: job.events.put(Delta(text)),
                lambda: job.cancelled or job.expired(),
            )
        except ServiceError as exc:
            return Failed(exc)
        except Exception:
            log.exception("generation failed for %s", job.id)
            return Failed(Internal(f"generation failed (request {job.id}); see the server log"))
        finally:
            self._job_seconds = 0.8 * self._job_seconds + 0.2 * (time.monotonic() - picked)
        if result.finish_reason == "interrupted":
            if job.cancelled:
                return Failed(Cancelled("the client went away"))
            return Failed(Timeout(f"the request passed its {job.timeout_s:g} s deadline "
                                  f"after {result.completion_tokens} tokens"))
        done_at = time.monotonic()
        gen_s = done_at - picked
        return Done(
            finish_reason=result.finish_reason,
            usage=Usage(len(job.prompt_ids), result.completion_tokens),
            queued_ms=queued_ms,
            ttft_ms=result.ttft_s * 1000,
            total_ms=(done_at - job.created) * 1000,
            tokens_per_second=result.completion_tokens / gen_s if gen_s > 0 else 0.0,
        )

    def _drain(self, error: ServiceError) -> None:
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                return
            if job is not _STOP:
                job.events.put(Failed(error))
