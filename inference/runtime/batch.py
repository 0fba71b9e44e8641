"""The running batch: the jobs the inference thread steps together, how each one ends, and
the times the ended ones measured.

The worker (runtime/worker.py) admits a job into the batch; from then on the batch steps it
with the others (runtime/engine.py) and hands its text out as it comes. Every job leaves
with exactly one terminal item on its reply queue: Done when its answer is complete, Failed
when it leaves early. A job's own failure (its sampling, grammar or text: `stream.error`)
ends that job alone, as its error or, for an unexpected exception, as Internal with its
request id; the others in the step go on untouched. Only a failing forward, which is
everyone's, ends the jobs of that step. The log gets request ids, error kinds and code
places, never a request's content.

A finished job's time, and the engine's own time for the prompt rows it computed, fold into
running averages: the estimates admission and a full queue's Retry-After are made of. The
prefill rate is the engine's work, not the time to the first token: a short prompt that
waited beside a long one's prefill teaches nothing about prompt tokens per second.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Protocol

from inference.runtime.budget import answer_room
from inference.runtime.jobs import Delta, Done, Failed, Generation, Job, Sampling, Thought, Usage
from service.errors import Internal, ServiceError, Timeout, fault_summary
from service.log_text import printable

log = logging.getLogger("deskchat.worker")

THOUGHT_SLACK = 1.5  # a step's time varies: the answer's room is kept with this to spare
MAX_PARAM_IN_LOG = 120  # characters of a request field's path in a log line
FIRST_GUESS_S = 5.0  # a job's time until one has been measured (the warm-up replaces it)
JOB_TIME_WEIGHT = 0.2  # weight of the newest measured job in the running average
# Prefill (the prompt's forward pass, up to the first token) in seconds per prompt token,
# until one has been measured: 500 tokens/s, the embedded model's rate on a 4,031-token
# prompt on the quiet 2-core machine (7-9 s). The warm-up replaces it.
FIRST_PREFILL_GUESS_S = 1 / 500


class StreamLike(Protocol):
    finish: str | None
    error: Exception | None  # what ended this stream alone inside a step
    completion_tokens: int
    ttft_s: float

    def take_text(self) -> str: ...

    def take_thought(self) -> str: ...

    def take_logprobs(self) -> tuple: ...


class EngineLike(Protocol):
    name: str
    batch_invariant: bool  # a row's result is the same alone or beside others
    last_forward: tuple[int, float] | None  # the last step's forward: (rows, seconds)

    def open(self, prompt_ids, sampling: Sampling) -> StreamLike: ...

    def step(self, streams: list) -> None: ...

    def close(self, stream, interrupted: bool = False) -> Generation: ...

    def cache_bytes(self, prompt_tokens: int, max_tokens: int) -> int: ...

    def idle(self) -> None: ...

    def prefill_step_s(self, streams: list) -> float | None: ...


@dataclass
class Running:
    job: Job
    stream: StreamLike
    picked: float  # when the job left the FIFO
    reserved: int  # KV cache bytes held for it


class Batch:
    """The running jobs. The inference thread alone steps them and adds or removes them,
    under `lock` (the worker's, which also guards its FIFO: a job is waiting, running or
    ended, and moves between them only under it)."""

    def __init__(self, lock: threading.Condition):
        self._lock = lock
        self.entries: list[Running] = []
        self._job_seconds: float | None = None  # average measured job time; None: none yet
        # Prompt rows computed and their seconds, each sum decayed by JOB_TIME_WEIGHT per
        # finished job: a one-row prefill (the rest from the prefix cache) weighs one row.
        self._prefill_tokens = 0.0
        self._prefill_s = 0.0

    def join(self, entry: Running) -> None:
        with self._lock:
            self.entries.append(entry)

    # -- a step -----------------------------------------------------------------------------

    def step(self, engine: EngineLike) -> bool:
        """One step of every running job; False when the forward failed, which ends them
        all."""
        streams = [r.stream for r in self.entries]
        try:
            engine.step(streams)
        except Exception as exc:  # the forward: every job in it
            ids = ", ".join(r.job.id for r in self.entries)
            log.error("a generation step failed for %s: %s", ids, fault_summary(exc))
            for entry in list(self.entries):
                why = f"generation failed (request {entry.job.id}); see the server log"
                self.leave(engine, entry, Internal(why))
            return False
        return True

    def settle(self, engine: EngineLike) -> None:
        """After a step: each job's new text goes out; the finished and the failed leave; a
        thought that would leave its answer no time before the deadline is closed."""
        self._close_late_thoughts(engine)
        for entry in list(self.entries):
            if entry.stream.error is not None:
                self.leave(engine, entry, own_failure(entry.job, entry.stream.error, "its step"))
                continue
            self._deliver(entry)
            if entry.stream.finish is not None:
                try:
                    self._finish(engine, entry)  # its held-back text is detokenized here
                except Exception as exc:
                    self.leave(engine, entry, own_failure(entry.job, exc, "its finish"))

    def _close_late_thoughts(self, engine: EngineLike) -> None:
        """At the last forward's pace, the answer's room (thought.answer_room tokens, one at
        least) must still fit before the job's deadline, with THOUGHT_SLACK to spare: a
        thought past that point is closed by the server at its next token."""
        last = getattr(engine, "last_forward", None)
        if not last:
            return
        now = time.monotonic()
        for entry in self.entries:
            split = getattr(entry.stream, "split", None)
            if split is None or not split.thinking:
                continue
            room = max(answer_room(entry.stream.budget), 1)
            if entry.job.deadline - now < room * last[1] * THOUGHT_SLACK:
                split.close_soon()

    def _finish(self, engine: EngineLike, entry: Running) -> None:
        job = entry.job
        result = engine.close(entry.stream)
        self._deliver(entry)
        done_at = time.monotonic()
        if result.prefill_tokens > 0:
            self._measured_prefill(result.prefill_tokens, result.prefill_s)
        gen_s = done_at - entry.picked
        self._measured(gen_s)
        self.end(
            entry,
            Done(
                finish_reason=result.finish_reason,
                usage=Usage(len(job.prompt_ids), result.completion_tokens),
                queued_ms=(entry.picked - job.created) * 1000,
                ttft_ms=result.ttft_s * 1000,
                total_ms=(done_at - job.created) * 1000,
                tokens_per_second=result.completion_tokens / gen_s if gen_s > 0 else 0.0,
                draft_tokens=result.accepted,
                drafted_tokens=result.drafted,
                steps=result.steps,
                thought_cut=result.thought_cut,
            ),
        )

    @staticmethod
    def _deliver(entry: Running) -> None:
        """The text and the logprob entries the stream has made since the last Delta."""
        if thought := entry.stream.take_thought():
            entry.job.events.put(Thought(thought))
        text, logprobs = entry.stream.take_text(), entry.stream.take_logprobs()
        if text or logprobs:
            entry.job.events.put(Delta(text, logprobs))

    # -- leaving ----------------------------------------------------------------------------

    def leave(self, engine: EngineLike, entry: Running, error: ServiceError) -> None:
        """Ends a running job early: its cache is released, the others go on."""
        try:
            engine.close(entry.stream, interrupted=True)
        finally:
            self.end(entry, Failed(error))

    def end(self, entry: Running, outcome: Done | Failed) -> None:
        with self._lock:
            if entry in self.entries:
                self.entries.remove(entry)
        entry.job.events.put(outcome)

    @staticmethod
    def timed_out(entry: Running) -> Timeout:
        return Timeout(
            f"the request passed its {entry.job.timeout_s:g} s deadline after "
            f"{entry.stream.completion_tokens} tokens"
        )

    # -- the times measured -----------------------------------------------------------------

    def expected_start_s(self, position: int, max_batch: int) -> float:  # with the lock held
        """Free batch places start jobs at once. Past them, a job waits for `ahead + 1` jobs
        to end: the first when the oldest running one reaches the average job time (a full
        average if none runs yet), then one every average / max_batch, as `max_batch` jobs
        run side by side."""
        ahead = position - (max_batch - len(self.entries))
        if ahead < 0:
            return 0.0
        per_job = FIRST_GUESS_S if self._job_seconds is None else self._job_seconds
        rest = per_job
        if self.entries:
            oldest = min(r.picked for r in self.entries)
            rest = max(0.0, per_job - (time.monotonic() - oldest))
        return rest + ahead * per_job / max_batch

    def expected_prefill_s(self, prompt_tokens: int) -> float:
        """Expected seconds of prefill (to the first token) for a prompt of that many tokens,
        at the measured rate."""
        per_token = self.prefill_s_per_token
        return prompt_tokens * (FIRST_PREFILL_GUESS_S if per_token is None else per_token)

    @property
    def prefill_s_per_token(self) -> float | None:
        """The measured seconds per computed prompt token; None before any was measured."""
        if self._prefill_tokens == 0:
            return None
        return self._prefill_s / self._prefill_tokens

    @property
    def measured(self) -> bool:
        """True once a job has been timed: the estimates are measurements, not guesses."""
        return self._job_seconds is not None and self._prefill_tokens > 0

    def _measured(self, job_s: float) -> None:
        """Fold a finished job's time into the average; the first one replaces the guess."""
        with self._lock:
            if self._job_seconds is None:
                self._job_seconds = job_s
            else:
                self._job_seconds += JOB_TIME_WEIGHT * (job_s - self._job_seconds)

    def _measured_prefill(self, tokens: int, seconds: float) -> None:
        """Fold a job's computed prompt rows and their seconds into the decayed sums."""
        keep = 1.0 - JOB_TIME_WEIGHT
        with self._lock:
            self._prefill_tokens = keep * self._prefill_tokens + tokens
            self._prefill_s = keep * self._prefill_s + seconds


def own_failure(job: Job, error: Exception, where: str) -> ServiceError:
    """What one job's failure tells its client: the request's fault as it is (e.g. a JSON
    schema that dead-ends: invalid_request), anything else as Internal with the request id,
    logged by kind and code place only."""
    if isinstance(error, ServiceError):
        param = printable(error.param or "-", MAX_PARAM_IN_LOG)  # a request's field path
        log.info("request %s ended in %s: %s (%s)", job.id, where, error.type, param)
        return error
    log.error("request %s failed in %s: %s", job.id, where, fault_summary(error))
    return Internal(f"generation failed (request {job.id}); see the server log")
