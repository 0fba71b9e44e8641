"""The Flask app factory: /chat and /health, and the one place errors become JSON.

Handlers validate, turn the request into a Job (`_job_for`), hand it to the worker and relay
its reply queue as JSON or SSE. They never call the model.
"""

from __future__ import annotations

import itertools
import json
import logging
import queue
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from flask import Flask, Response, g, jsonify, request
from werkzeug.exceptions import HTTPException

from inference.config import Config
from inference.errors import (
    Internal,
    InvalidRequest,
    Loading,
    MethodNotAllowed,
    NotFound,
    PayloadTooLarge,
    ServiceError,
    Timeout,
)
from inference.jobs import Delta, Done, Event, Failed, Job, Sampling, new_request_id
from web.validation import ChatRequest, validate_chat_request

log = logging.getLogger("deskchat.http")

POLL_S = 0.05  # how often a waiting handler looks at its client and its job
DEADLINE_GRACE_S = 5.0  # the worker reports a deadline itself; this only guards against a hang


@dataclass
class Runtime:
    """What the model side hands the web layer once loaded; until then /chat answers 503."""

    worker: object | None = None
    prompts: object | None = None
    model_name: str | None = None
    status: str = "starting"

    @property
    def ready(self) -> bool:
        return self.worker is not None


_HTTP_ERRORS = {404: NotFound, 405: MethodNotAllowed, 413: PayloadTooLarge}


def create_app(config: Config, runtime: Runtime) -> Flask:
    app = Flask("deskchat")
    app.config["MAX_CONTENT_LENGTH"] = config.max_body_bytes

    @app.before_request
    def _start():
        g.request_id = new_request_id()
        g.started = time.monotonic()

    @app.after_request
    def _tag(response: Response) -> Response:
        response.headers["X-Request-Id"] = g.get("request_id", "")
        return response

    @app.errorhandler(ServiceError)
    def _service_error(exc: ServiceError):
        _log_request(g.get("request_id", "-"), exc.status_code, None, exc)
        response = jsonify(exc.to_dict())
        response.status_code = exc.status_code
        response.headers.update(exc.headers)
        return response

    @app.errorhandler(HTTPException)
    def _http_error(exc: HTTPException):
        kind = _HTTP_ERRORS.get(exc.code or 500)
        if kind is PayloadTooLarge:
            error = kind(f"the request body is over the {config.max_body_bytes}-byte limit")
        elif kind is not None:
            error = kind(f"{request.method} {request.path}: {exc.name.lower()}")
        else:
            error = InvalidRequest(exc.description or "bad request")
            error.status_code = exc.code or 400
        response = _service_error(error)
        if exc.code == 405 and exc.response is None:
            response.headers["Allow"] = ", ".join(exc.valid_methods or [])
        return response

    @app.errorhandler(Exception)
    def _unexpected(exc: Exception):
        log.exception("request %s failed", g.get("request_id", "-"))
        return _service_error(Internal(f"internal error (request {g.get('request_id')})"))

    @app.get("/health")
    def health():
        if not runtime.ready:
            return jsonify({"status": "loading", "detail": runtime.status}), 503
        worker = runtime.worker
        body = {
            "status": "ok" if worker.alive else "error",
            "model": runtime.model_name,
            "queue": {"depth": worker.depth, "capacity": worker.capacity},
            "busy": worker.busy,
        }
        return jsonify(body), 200 if worker.alive else 503

    @app.post("/chat")
    def chat():
        if not runtime.ready:
            raise Loading()
        body = request.get_json(force=True, silent=True)  # tools often omit Content-Type
        if body is None:
            raise InvalidRequest("the body must be a JSON object")
        chat_request = validate_chat_request(body)
        job = runtime.worker.submit(_job_for(chat_request, config, runtime.prompts))
        disconnected = request.environ.get("waitress.client_disconnected", lambda: False)
        events = _relay(job, disconnected)
        if chat_request.stream:
            return _stream(job, events, runtime.model_name)
        return _answer(job, events, runtime.model_name)

    return app


def _job_for(chat_request: ChatRequest, config: Config, prompts) -> Job:
    """The one place a validated request becomes a Job: prompt ids, limits, deadline."""
    prompt_ids = prompts.encode(chat_request.messages, chat_request.system)
    prompts.check_fits(len(prompt_ids))
    wanted = chat_request.max_tokens or config.max_tokens_default
    sampling = Sampling(
        max_tokens=min(wanted, config.max_tokens_cap, prompts.context_tokens - len(prompt_ids)),
        temperature=chat_request.temperature,
        top_p=chat_request.top_p,
        stop=chat_request.stop,
    )
    return Job(prompt_ids, sampling, timeout_s=config.request_timeout, id=g.request_id)


def _relay(job: Job, disconnected: Callable[[], bool]) -> Iterator[Event]:
    """The job's events up to and including its terminal one; cancels it if the client left.

    Never waits forever: past the deadline (plus grace) it gives up with a Timeout.
    """
    while True:
        if disconnected():
            job.cancel()
            return
        try:
            event = job.events.get(timeout=POLL_S)
        except queue.Empty:
            if time.monotonic() > job.deadline + DEADLINE_GRACE_S:
                job.cancel()
                yield Failed(Timeout(f"no answer within the {job.timeout_s:g} s deadline"))
                return
            continue
        yield event
        if not isinstance(event, Delta):
            return


def _done_fields(job: Job, done: Done) -> dict:
    return {
        "finish_reason": done.finish_reason,
        "usage": {"prompt_tokens": done.usage.prompt_tokens,
                  "completion_tokens": done.usage.completion_tokens},
        "timings": done.timings(),
    }


def _answer(job: Job, events: Iterator[Event], model: str):
    parts = []
    for event in events:
        if isinstance(event, Delta):
            parts.append(event.text)
        elif isinstance(event, Failed):
            raise event.error
        else:
            _log_request(job.id, 200, event)
            return jsonify({"id": job.id, "model": model, "response": "".join(parts),
                            **_done_fields(job, event)})
    job.cancel()
    _log_request(job.id, 499, None)
    return Response(status=499)  # the client left; nobody reads this


def _sse(data: dict, event: str | None = None) -> str:
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(data, ensure_ascii=False)}\n\n"


def _stream(job: Job, events: Iterator[Event], model: str) -> Response:
    first = next(events, None)
    if isinstance(first, Failed):  # nothing sent yet: a plain JSON error with its status
        raise first.error

    def body() -> Iterator[str]:
        status, done = 499, None
        try:
            pending = [first] if first is not None else []
            for event in itertools.chain(pending, events):
                if isinstance(event, Delta):
                    yield _sse({"id": job.id, "delta": event.text})
                elif isinstance(event, Done):
                    status, done = 200, event
                    yield _sse({"id": job.id, "model": model, "done": True,
                                **_done_fields(job, event)})
                else:
                    status = event.error.status_code
                    yield _sse(event.error.to_dict(), event="error")
        finally:
            job.cancel()  # a no-op when finished; stops the worker when the client left
            _log_request(job.id, status, done)

    return Response(body(), mimetype="text/event-stream",
                    headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _log_request(request_id: str, status: int, done: Done | None,
                 error: ServiceError | None = None) -> None:
    """One line per request. Never the prompt or the answer: users' questions are private."""
    if done is None:
        log.info("request %s status=%d%s", request_id, status,
                 f" error={error.type}" if error else "")
        return
    log.info("request %s status=%d queued_ms=%.0f ttft_ms=%.0f completion_tokens=%d "
             "tokens_per_s=%.1f", request_id, status, done.queued_ms, done.ttft_ms,
             done.usage.completion_tokens, done.tokens_per_second)
