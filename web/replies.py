"""Relaying a job's reply queue to its client: as one JSON answer or as SSE events, while
watching the client (gone: cancel the job) and the deadline (passed: 504), and logging one
line per request.
"""

from __future__ import annotations

import itertools
import json
import logging
import queue
import time
from collections.abc import Callable, Iterator

from flask import Response, jsonify

from inference.errors import ServiceError, Timeout
from inference.jobs import Delta, Done, Event, Failed, Job

log = logging.getLogger("deskchat.http")

POLL_S = 0.05  # how often a waiting handler looks at its client and its job
# A running job's deadline is enforced by the worker between tokens; this is only the
# handler's guard against a generation step that never returns.
RUNNING_GRACE_S = 5.0


def relay(job: Job, disconnected: Callable[[], bool]) -> Iterator[Event]:
    """The job's events up to and including its terminal one; cancels it if the client left.

    Never waits forever: a queued job is given up at its deadline, a running one a little
    after, both as a Timeout.
    """
    while True:
        if disconnected():
            job.cancel()
            return
        try:
            event = job.events.get(timeout=POLL_S)
        except queue.Empty:
            now = time.monotonic()
            grace = RUNNING_GRACE_S if job.started else 0.0
            if now > job.deadline + grace:
                job.cancel()
                yield Failed(Timeout(f"no answer within the {job.timeout_s:g} s deadline"))
                return
            continue
        yield event
        if not isinstance(event, Delta):
            return


def _done_fields(done: Done) -> dict:
    return {
        "finish_reason": done.finish_reason,
        "usage": {
            "prompt_tokens": done.usage.prompt_tokens,
            "completion_tokens": done.usage.completion_tokens,
        },
        "timings": done.timings(),
    }


def answer(job: Job, events: Iterator[Event], model: str) -> Response:
    """Collect the whole answer; a Failed terminal is raised for the app's error handler."""
    parts = []
    for event in events:
        if isinstance(event, Delta):
            parts.append(event.text)
        elif isinstance(event, Failed):
            raise event.error
        else:
            log_request(job.id, 200, event)
            return jsonify(
                {"id": job.id, "model": model, "response": "".join(parts), **_done_fields(event)}
            )
    log_request(job.id, 499, None)
    return Response(status=499)  # the client left; nobody reads this


def _sse(data: dict, event: str | None = None) -> str:
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(data, ensure_ascii=False)}\n\n"


def stream(job: Job, events: Iterator[Event], model: str) -> Response:
    """SSE: a `data:` event per text piece, then the done event or an `event: error`."""
    first = next(events, None)
    if isinstance(first, Failed):  # nothing sent yet: a plain JSON error with its status
        raise first.error

    def body() -> Iterator[str]:
        status, done, error = 499, None, None
        try:
            for event in itertools.chain([first] if first else [], events):
                if isinstance(event, Delta):
                    yield _sse({"id": job.id, "delta": event.text})
                elif isinstance(event, Done):
                    status, done = 200, event
                    yield _sse({"id": job.id, "model": model, "done": True, **_done_fields(event)})
                else:
                    status, error = event.error.status_code, event.error
                    yield _sse(event.error.to_dict(), event="error")
        finally:
            job.cancel()  # a no-op when finished; stops the worker when the client left
            log_request(job.id, status, done, error)

    return Response(
        body(),
        mimetype="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


def log_request(
    request_id: str, status: int, done: Done | None, error: ServiceError | None = None
) -> None:
    """One line per request. Never the prompt or the answer: users' questions are private."""
    if done is None:
        log.info(
            "request %s status=%d%s", request_id, status, f" error={error.type}" if error else ""
        )
        return
    log.info(
        "request %s status=%d queued_ms=%.0f ttft_ms=%.0f completion_tokens=%d tokens_per_s=%.1f",
        request_id,
        status,
        done.queued_ms,
        done.ttft_ms,
        done.usage.completion_tokens,
        done.tokens_per_second,
    )
