"""The one inference thread and its bounded FIFO.

`submit()` never blocks: a full queue is an immediate Overloaded. Slots belong to live jobs:
a waiting job whose client left or whose deadline passed is taken out of the FIFO (and ended)
whenever anyone looks at the queue, so it never counts against `--max-queue` nor in `depth`.
The thread takes live jobs in order, runs the engine, and ends every job with exactly one
terminal item on the job's reply queue. An exception inside the engine becomes that job's
Internal error; the thread goes on serving.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
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
from inference.host import between_jobs  # latency (issue 11): GC between jobs
from inference.jobs import Delta, Done, Failed, Generation, Job, Sampling, Usage

log = logging.getLogger("deskchat.worker")

IDLE_TICK_S = 1.0  # an idle thread still beats this often, for the watchdog
FIRST_GUESS_S = 5.0  # a job's time until one has been measured (the warm-up replaces it)
JOB_TIME_WEIGHT = 0.2  # weight of the newest measured job in the running average
# Prefill (the prompt's forward pass, up to the first token) in seconds per prompt token,
# until one has been measured: 500 tokens/s, the embedded model's rate on a 4,031-token
# prompt on the quiet 2-core machine (7-9 s). The warm-up replaces it.
FIRST_PREFILL_GUESS_S = 1 / 500


class EngineLike(Protocol):
    name: str

    def run(self, prompt_ids, sampling: Sampling, emit, should_stop) -> Generation: ...


class Worker:
    """Owns the engine and the only thread that may call it: start(), submit(job), stop()."""

    def __init__(self, engine: EngineLike | None, max_queue: int):
        self.engine = engine  # None until start(load) has built it in the thread
        self.capacity = max_queue
        # The FIFO of waiting jobs. One lock guards it and `_current`: a job is either
        # waiting, or running, or ended, and moves between them only under the lock.
        self._waiting: deque[Job] = deque()
        self._lock = threading.Condition()
        self._thread = threading.Thread(target=self._loop, name="inference", daemon=True)
        self._stopping = threading.Event()
        self._current: Job | None = None
        self._current_picked = 0.0  # when the running job was taken
        self._job_seconds: float | None = None  # average measured job time; None: none yet
        self._prefill_s_per_token: float | None = None  # average measured; None: none yet
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
        self._end_waiting("the server is stopping")  # also wakes the thread if it waits
        if self._thread.ident is not None:  # started
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def depth(self) -> int:
        """Live jobs waiting in the FIFO (not counting the one running)."""
        with self._lock:
            self._prune()
            return len(self._waiting)

    @property
    def busy(self) -> bool:
        return self._current is not None

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
                retry_after_s=self._expected_start_s(0),
            )

    def expected_start_s(self, position: int) -> float:
        """Expected seconds until the job waiting at `position` (0: the head) starts: the
        rest of the running job, then one average job per job ahead of it. For position 0
        it is when a waiting slot frees."""
        with self._lock:
            return self._expected_start_s(position)

    def _expected_start_s(self, position: int) -> float:  # with the lock held
        per_job = FIRST_GUESS_S if self._job_seconds is None else self._job_seconds
        rest = 0.0
        if self._current is not None:
            # A job running longer than the average is expected to end any moment.
            rest = max(0.0, per_job - (time.monotonic() - self._current_picked))
        return rest + position * per_job

    def expected_prefill_s(self, prompt_tokens: int) -> float:
        """Expected seconds of prefill (to the first token) for a prompt of that many tokens,
        at the measured rate."""
        per_token = self._prefill_s_per_token
        return prompt_tokens * (FIRST_PREFILL_GUESS_S if per_token is None else per_token)

    @property
    def measured(self) -> bool:
        """True once a job has been timed: the estimates are measurements, not guesses."""
        return self._job_seconds is not None and self._prefill_s_per_token is not None

    def run_now(self, prompt_ids: list[int], sampling: Sampling) -> Done:
        """Run one generation in the worker thread and wait for it (used for warm-up)."""
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

    def _next_job(self) -> Job | None:
        """The next live job, or None after an idle tick (or when stopping)."""
        with self._lock:
            self._prune()
            if not self._waiting and not self._stopping.is_set():
                self._lock.wait(IDLE_TICK_S)
                self._prune()
            if not self._waiting or self._stopping.is_set():
                return None
            self._current = self._waiting.popleft()
            self._current_picked = time.monotonic()
            return self._current

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
        while not self._stopping.is_set():
            self.heartbeat = time.monotonic()
            between_jobs(len(self._waiting))  # latency (issue 11): GC here, not mid-job
            job = self._next_job()
            if job is None:
                continue
            try:
                outcome = self._serve(job)
            except BaseException:  # the thread is going down: its job still gets its end
                job.events.put(Failed(Internal(f"the inference thread died (request {job.id})")))
                self._stopping.set()  # refuse new jobs before the thread is gone for good
                self._end_waiting("the inference thread died")
                raise
            finally:
                with self._lock:
                    self._current = None
            job.events.put(outcome)

    def _should_stop(self, job: Job) -> bool:
        self.heartbeat = time.monotonic()
        return job.cancelled or job.expired() or self._stopping.is_set()

    def _serve(self, job: Job) -> Done | Failed:
        picked = self._current_picked
        job.started = True
        queued_ms = (picked - job.created) * 1000
        if self._stopping.is_set():
            return Failed(Unavailable("the server is stopping"))
        if job.cancelled:
            self._count_cancelled(job, "queued")
            return Failed(Cancelled("the client went away while queued"))
        if job.expired():
            return Failed(self._expired_in_queue(job))
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
        if result.completion_tokens > 0 and result.ttft_s > 0 and job.prompt_ids:
            self._measured_prefill(result.ttft_s / len(job.prompt_ids))
        if result.finish_reason == "interrupted":
            return Failed(self._interruption(job, result))
        gen_s = done_at - picked
        self._measured(gen_s)
        return Done(
            finish_reason=result.finish_reason,
            usage=Usage(len(job.prompt_ids), result.completion_tokens),
            queued_ms=queued_ms,
            ttft_ms=result.ttft_s * 1000,
            total_ms=(done_at - job.created) * 1000,
            tokens_per_second=result.completion_tokens / gen_s if gen_s > 0 else 0.0,
        )

    def _measured(self, job_s: float) -> None:
        """Fold a finished job's time into the average; the first one replaces the guess."""
        with self._lock:
            if self._job_seconds is None:
                self._job_seconds = job_s
            else:
                self._job_seconds += JOB_TIME_WEIGHT * (job_s - self._job_seconds)

    def _count_cancelled(self, job: Job, stage: str) -> None:
        """A job whose client left; not one its handler gave up on at the deadline (a timeout)."""
        if not job.expired():
            self.cancellations[stage] += 1

    def _measured_prefill(self, per_token_s: float) -> None:
        """Fold a prefill's seconds per prompt token into the average, as _measured does."""
        if self._prefill_s_per_token is None:
            self._prefill_s_per_token = per_token_s
        else:
            self._prefill_s_per_token += JOB_TIME_WEIGHT * (per_token_s - self._prefill_s_per_token)

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
