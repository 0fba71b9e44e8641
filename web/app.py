"""The Flask app factory: /chat and /health, and the one place errors become JSON.

Handlers validate, turn the request into a Job (`job_for`), hand it to the worker and relay
its reply queue (web/replies.py). They never call the model.
"""

from __future__ import annotations

import logging
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
)
from inference.jobs import Job, Sampling, new_request_id
from inference.prompt import PromptBuilder
from inference.worker import Worker
from web.proxy import client_address, parse_networks, request_id_from
from web.replies import answer, log_request, relay, stream
from web.validation import ChatRequest, parse_json, validate_chat_request

log = logging.getLogger("deskchat.http")

MAX_PATH_IN_ERROR = 100  # characters of an unknown path echoed back in a 404


@dataclass
class Runtime:
    """What the model side hands the web layer once loaded; until then /chat answers 503."""

    worker: Worker | None = None
    prompts: PromptBuilder | None = None
    model_name: str | None = None
    status: str = "starting"

    @property
    def ready(self) -> bool:
        return self.worker is not None


def create_app(config: Config, runtime: Runtime) -> Flask:
    app = Flask("deskchat")
    app.config["MAX_CONTENT_LENGTH"] = config.max_body_bytes

    trusted_proxies = parse_networks(config.trusted_proxies)

    @app.before_request
    def _start():
        g.request_id = request_id_from(request.headers) or new_request_id()
        forwarded_for = request.headers.get("X-Forwarded-For")
        g.client = client_address(request.remote_addr, forwarded_for, trusted_proxies)

    @app.after_request
    def _tag(response: Response) -> Response:
        response.headers["X-Request-Id"] = g.get("request_id", "")
        return response

    @app.errorhandler(ServiceError)
    def _service_error(exc: ServiceError):
        log_request(g.get("request_id", "-"), exc.status_code, None, exc)
        response = jsonify(exc.to_dict())
        response.status_code = exc.status_code
        response.headers.update(exc.headers)
        return response

    @app.errorhandler(HTTPException)
    def _http_error(exc: HTTPException):
        where = f"{request.method} {request.path[:MAX_PATH_IN_ERROR]}"
        if exc.code == 404:
            error: ServiceError = NotFound(f"{where}: no such endpoint")
        elif exc.code == 405:
            error = MethodNotAllowed(
                f"{where}: method not allowed",
                headers={"Allow": ", ".join(exc.valid_methods or [])},
            )
        elif exc.code == 413:
            error = PayloadTooLarge(
                f"the request body is over the {config.max_body_bytes}-byte limit"
            )
        else:
            error = InvalidRequest(f"{where}: {exc.description}")
        return _service_error(error)

    @app.errorhandler(Exception)
    def _unexpected(exc: Exception):
        log.exception("request %s failed", g.get("request_id", "-"))
        return _service_error(Internal(f"internal error (request {g.get('request_id')})"))

    @app.get("/health", provide_automatic_options=False)
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

    @app.post("/chat", provide_automatic_options=False)
    def chat():
        if not runtime.ready:
            raise Loading()
        chat_request = validate_chat_request(parse_json(request.get_data(cache=False)))
        runtime.worker.check_room()  # a full queue refuses before the tokenizer's work
        job = job_for(chat_request, config, runtime.prompts, g.request_id)
        runtime.worker.submit(job)
        disconnected = request.environ.get("waitress.client_disconnected", lambda: False)
        events = relay(job, disconnected)
        if chat_request.stream:
            return stream(job, events, runtime.model_name)
        return answer(job, events, runtime.model_name)

    return app


def job_for(
    chat_request: ChatRequest, config: Config, prompts: PromptBuilder, request_id: str
) -> Job:
    """The one place a validated request becomes a Job: prompt ids, limits, deadline."""
    prompt_ids = prompts.encode(chat_request.messages, chat_request.system)
    prompts.check_fits(len(prompt_ids))
    wanted = chat_request.max_tokens or config.max_tokens_default
    sampling = Sampling(
        max_tokens=min(wanted, config.max_tokens_cap),  # the engine also bounds it by context
        temperature=chat_request.temperature,
        top_p=chat_request.top_p,
        stop=chat_request.stop,
    )
    return Job(prompt_ids, sampling, timeout_s=config.request_timeout, id=request_id)
