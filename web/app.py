"""The Flask app factory: the dialects' blueprints, /health, /metrics, the chat page, the
API-key gate, the count of every request for the metrics, and the one place errors become
HTTP responses (status and headers from web/errors.py, the body in the shape of the route's
dialect).

Handlers validate, hand a Job to the worker and relay its reply queue (web/relay.py). They
never call the model.
"""

from __future__ import annotations

import logging

from flask import Flask, Response, g, jsonify, request
from werkzeug.exceptions import HTTPException

from inference.runtime.jobs import new_request_id
from service.config import Config
from service.errors import (
    Cancelled,
    Internal,
    InvalidRequest,
    PayloadTooLarge,
    ServiceError,
    fault_summary,
)
from service.log_text import printable
from web import metrics, page
from web.access.auth import Gate
from web.access.proxy import client_address, parse_networks, request_id_from
from web.dialects import chat_api, ollama_api, openai_api, tokenize
from web.errors import MethodNotAllowed, NotFound, Refused, headers_of, status_of
from web.request_log import RequestLog
from web.runtime import Runtime

log = logging.getLogger("deskchat.http")

MAX_PATH_IN_ERROR = 100  # characters of an unknown path echoed back in a 404
MAX_METHOD_IN_ERROR = 20  # ... and of a method in a 405
# Each dialect's error shape, by path prefix; anything else gets /chat's.
ERROR_SHAPES = (("/v1/", openai_api.error_body), ("/api/", ollama_api.error_body))

__all__ = ["Runtime", "create_app"]


def error_body(path: str, error: ServiceError, status: int) -> dict:
    """The error's body in the dialect of the route asked for: the one choice of shaper."""
    for prefix, shape in ERROR_SHAPES:
        if path.startswith(prefix):
            return shape(error, status)
    return chat_api.error_body(error, status)


def create_app(config: Config, runtime: Runtime) -> Flask:
    app = Flask("deskchat")
    app.config["MAX_CONTENT_LENGTH"] = config.max_body_bytes
    gate = Gate(runtime.keys)

    trusted_proxies = parse_networks(config.trusted_proxies or "")

    @app.before_request
    def _start():
        g.request_id = request_id_from(request.headers) or new_request_id()
        forwarded_for = request.headers.get("X-Forwarded-For")
        g.client = client_address(request.remote_addr, forwarded_for, trusted_proxies)
        g.log = RequestLog(g.request_id, printable(request.path, MAX_PATH_IN_ERROR), g.client)
        g.disconnected = request.environ.get("waitress.client_disconnected", lambda: False)
        g.log.key_name = gate.admit(request.method, request.path, request.headers, g.client)

    @app.after_request
    def _tag(response: Response) -> Response:
        response.headers["X-Request-Id"] = g.get("request_id", "")
        return response

    counted = metrics.Metrics(config, runtime)

    def refused(method: str, path: str, error: Refused) -> dict:
        """What waitress answered itself is counted too, under the route it asked for, and
        answered in that route's dialect."""
        try:
            rule = app.url_map.bind("").match(path, method, return_rule=True)[0].rule
        except (HTTPException, UnicodeError, ValueError):
            rule = metrics.UNMATCHED_ROUTE
        counted.observe_refused(rule, error.status, error.type)
        return error_body(path, error, error.status)

    app.extensions["deskchat.refused"] = refused

    @app.after_request
    def _count(response: Response) -> Response:
        # Counted when the response closes: a stream's final status is only known then.
        request_log, route = g.get("log"), metrics.route_of_request()
        if request_log is None:
            return response
        status = response.status_code
        if response.direct_passthrough:  # a file (the page, /assets/*) handed to waitress as
            counted.observe(route, request_log, status)  # is: werkzeug never calls its close
        else:
            response.call_on_close(lambda: counted.observe(route, request_log, status))
        return response

    @app.errorhandler(ServiceError)
    def _service_error(exc: ServiceError):
        status = status_of(exc)
        if "log" in g:
            g.log.finish(status, error=exc)
        if isinstance(exc, Cancelled):
            return Response(status=499)  # the client left; nobody reads this
        response = jsonify(error_body(request.path, exc, status))
        response.status_code = status
        response.headers.update(headers_of(exc))
        return response

    @app.errorhandler(HTTPException)
    def _http_error(exc: HTTPException):
        where = f"{request.method[:MAX_METHOD_IN_ERROR]} {request.path[:MAX_PATH_IN_ERROR]}"
        if exc.code == 404:
            error: ServiceError = NotFound(f"{where}: no such endpoint")
        elif exc.code == 405:
            error = MethodNotAllowed(f"{where}: method not allowed", exc.valid_methods or [])
        elif exc.code == 413:
            error = PayloadTooLarge(
                f"the request body is over the {config.max_body_bytes}-byte limit"
            )
        else:
            error = InvalidRequest(f"{where}: {exc.description}")
        return _service_error(error)

    @app.errorhandler(Exception)
    def _unexpected(exc: Exception):
        # By class and code place: the message may quote the request's content.
        log.error("request %s failed: %s", g.get("request_id", "-"), fault_summary(exc))
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
            "batch": {"running": worker.running, "capacity": worker.max_batch},
            "busy": worker.busy,
            "sampling_defaults": runtime.defaults.as_dict(),
        }
        if runtime.cpu is not None:
            body["cpu"] = runtime.cpu
        if runtime.decode_step is not None:
            body["decode_step"] = runtime.decode_step
        if runtime.weights_digest is not None:
            body["weights_sha256"] = runtime.weights_digest
        if runtime.prefixes is not None:
            body["prefix_cache"] = runtime.prefixes.as_dict()
        return jsonify(body), 200 if worker.alive else 503

    app.register_blueprint(chat_api.blueprint(config, runtime))
    app.register_blueprint(openai_api.blueprint(config, runtime))
    app.register_blueprint(tokenize.blueprint(config, runtime))
    app.register_blueprint(ollama_api.blueprint(config, runtime))
    app.register_blueprint(metrics.blueprint(counted))
    app.register_blueprint(page.blueprint())
    return app
