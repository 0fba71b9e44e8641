"""How each kind of ServiceError looks in HTTP: its status and its headers. The one place
statuses are decided; each dialect only shapes the body. The kinds that only the web side
raises (keys, routes) are declared here too; the shared ones are in service/errors.py.
"""

from __future__ import annotations

import math

from service.errors import Retryable, ServiceError


class Unauthorized(ServiceError):
    """No API key, or not one of ours."""

    type = "unauthorized"


class NotFound(ServiceError):
    type = "not_found"


class MethodNotAllowed(ServiceError):
    type = "method_not_allowed"

    def __init__(self, message: str, allowed: list[str]):
        super().__init__(message)
        self.allowed = allowed


class NotOffered(ServiceError):
    """A route of a dialect that deskchat does not offer (Ollama's model pulls and copies)."""

    type = "not_implemented"


class TooManyFailures(Retryable):
    """One address sent too many wrong keys within a minute."""

    type = "too_many_failures"


class Refused(ServiceError):
    """A request waitress answered itself, before Flask (malformed, too slow, too large, past
    the connection limit), with the status it chose; its kind is WAITRESS_KINDS'."""

    def __init__(self, reason: str, detail: str, status: int):
        self.status = status
        self.type = WAITRESS_KINDS.get(status, "internal")
        # waitress' own 500 carries a traceback in its detail: the reason alone then
        super().__init__(reason if self.type == "internal" else f"{reason}: {detail}")


# The one status table: each kind of error and the status it is answered with.
STATUS = {
    "invalid_request": 400,
    "unauthorized": 401,
    "not_found": 404,
    "method_not_allowed": 405,
    "too_large": 413,
    "too_many_failures": 429,
    "cancelled": 499,  # the client left; nobody reads it
    "internal": 500,
    "overloaded": 503,
    "loading": 503,
    "unavailable": 503,
    "timeout": 504,
    "not_implemented": 501,
    "http_version_not_supported": 505,
}
# The kind of each status waitress answers itself (anything else is `internal`): a request
# that did not arrive in time is a timeout (408; an answer that did not is a 504), headers
# over its limit are too large (431; a body is a 413).
WAITRESS_KINDS = {
    400: "invalid_request",
    408: "timeout",
    413: "too_large",
    431: "too_large",
    501: "not_implemented",
    503: "overloaded",
    505: "http_version_not_supported",
}
# Retry-After bounds. Under a second the official OpenAI client would retry at once (it reads
# retry-after-ms first); above 60 s older clients give up instead of waiting.
MIN_RETRY_AFTER_S = 1.0
MAX_RETRY_AFTER_S = 60.0


def status_of(error: ServiceError) -> int:
    if isinstance(error, Refused):
        return error.status
    return STATUS.get(error.type, 500)


def headers_of(error: ServiceError) -> dict[str, str]:
    headers: dict[str, str] = {}
    if isinstance(error, Retryable):
        wait = min(max(error.retry_after_s, MIN_RETRY_AFTER_S), MAX_RETRY_AFTER_S)
        headers["Retry-After"] = str(math.ceil(wait))
        headers["retry-after-ms"] = str(round(wait * 1000))
    if isinstance(error, MethodNotAllowed):
        headers["Allow"] = ", ".join(error.allowed)
    if isinstance(error, Unauthorized):
        headers["WWW-Authenticate"] = 'Bearer realm="deskchat"'
    return headers
