"""The one error type of the service: what went wrong, as a kind (`type`) and a message.

It knows nothing of HTTP: the web side (web/errors.py) decides each kind's status and headers,
and each API dialect renders the body in its own shape.
"""

from __future__ import annotations

import traceback

# Frames named in a logged fault: enough to find the bug, never the exception's message.
FAULT_FRAMES = 4


class ServiceError(Exception):
    type = "internal"

    def __init__(self, message: str, *, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param  # the request field at fault, when there is one


class InvalidRequest(ServiceError):
    type = "invalid_request"


class PayloadTooLarge(ServiceError):
    type = "too_large"


class Retryable(ServiceError):
    """An error worth retrying after `retry_after_s` seconds."""

    retry_after_s: float = 10.0

    def __init__(self, message: str, retry_after_s: float | None = None):
        super().__init__(message)
        if retry_after_s is not None:
            self.retry_after_s = retry_after_s


class Overloaded(Retryable):
    type = "overloaded"


class Loading(Retryable):
    type = "loading"
    retry_after_s = 5.0

    def __init__(self, message: str = "the model is still loading; try again shortly"):
        super().__init__(message)


class Unavailable(Retryable):
    """The server is stopping, or its inference thread is gone: retry after a restart."""

    type = "unavailable"


class Timeout(ServiceError):
    type = "timeout"


class Cancelled(ServiceError):
    """The client went away; nobody reads this, but the job still ends with one terminal item."""

    type = "cancelled"


class Internal(ServiceError):
    type = "internal"


def fault_summary(exc: BaseException) -> str:
    """An unexpected exception for the log: its class and innermost frames (file:line in
    function), without its message, which may quote a request's prompt, answer or schema
    (README: prompts and answers are never logged)."""
    frames = traceback.extract_tb(exc.__traceback__)[-FAULT_FRAMES:]
    where = " < ".join(
        f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno} in {f.name}" for f in frames[::-1]
    )
    return f"{type(exc).__name__} at {where or 'an unknown place'}"
