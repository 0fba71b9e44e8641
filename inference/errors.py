"""The one error type of the service. Each subclass knows its HTTP status and its `type`;
the web layer renders any of them as {"error": {"message", "type", "code"}} in one place.
"""

from __future__ import annotations


class ServiceError(Exception):
    status_code = 500
    type = "internal"

    def __init__(self, message: str, *, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message = message
        self.headers = headers or {}

    def to_dict(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "code": self.status_code}}


class InvalidRequest(ServiceError):
    status_code = 400
    type = "invalid_request"


class NotFound(ServiceError):
    status_code = 404
    type = "not_found"


class MethodNotAllowed(ServiceError):
    status_code = 405
    type = "method_not_allowed"


class PayloadTooLarge(ServiceError):
    status_code = 413
    type = "too_large"


class Overloaded(ServiceError):
    status_code = 503
    type = "overloaded"

    def __init__(self, message: str, retry_after_s: int):
        super().__init__(message, headers={"Retry-After": str(retry_after_s)})


class Loading(ServiceError):
    status_code = 503
    type = "loading"

    def __init__(self, message: str = "the model is still loading; try again shortly"):
        super().__init__(message, headers={"Retry-After": "5"})


class Unavailable(ServiceError):
    """The server is stopping, or its inference thread is gone: retry after a restart."""

    status_code = 503
    type = "unavailable"

    def __init__(self, message: str):
        super().__init__(message, headers={"Retry-After": "10"})


class Timeout(ServiceError):
    status_code = 504
    type = "timeout"


class Cancelled(ServiceError):
    """The client went away; nobody reads this, but the job still ends with one terminal item."""

    status_code = 499
    type = "cancelled"


class Internal(ServiceError):
    status_code = 500
    type = "internal"
