"""One log line per request: its id, route, key name, status and timings.

Never the prompt, the answer or the key itself: users' questions are private, keys secret.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from inference.runtime.jobs import Done
from service.errors import ServiceError

log = logging.getLogger("deskchat.http")


@dataclass
class RequestLog:
    request_id: str
    route: str
    client: str = "-"  # the address, or the one a trusted proxy forwarded
    key_name: str | None = None
    # What the line said, for the metrics counted when the response closes.
    status: int | None = None
    done: Done | None = None
    error: ServiceError | None = None

    def finish(self, status: int, done: Done | None = None, error: ServiceError | None = None):
        """Write the line; only the first call of a request counts."""
        if self.status is not None:
            return
        self.status, self.done, self.error = status, done, error
        who = f" key={self.key_name}" if self.key_name else ""
        head = (
            f"request {self.request_id} route={self.route} client={self.client}{who} "
            f"status={status}"
        )
        if done is None:
            log.info("%s%s", head, f" error={error.type}" if error else "")
            return
        log.info(
            "%s queued_ms=%.0f ttft_ms=%.0f completion_tokens=%d tokens_per_s=%.1f",
            head,
            done.queued_ms,
            done.ttft_ms,
            done.usage.completion_tokens,
            done.tokens_per_second,
        )
