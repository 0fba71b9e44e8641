"""Where a first token's time goes: the server's own part and the threads that waited for a
CPU meanwhile, read per request by the latency bench when it started the server itself.

From the request's start to its first text event: the server's queue and first step (its
`queued_ms + ttft_ms`), everything else (the request's way in, Flask, the template and
tokenizer, the first event's way out to the client), and the run-queue time
(/proc/.../schedstat) of the measuring client's thread, of the server's inference threads
(`deskchat-infer`: the inference thread and the native step's pool) and of its other threads
(HTTP, main). A wait is summed over a role's threads, so two threads waiting 2 ms at once
count 4 ms. Each thread's file is opened once and read with pread: a reading costs tens of
microseconds, taken before the request and after its first event has been timed.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from bench.stats import summary
from inference.host.process import INFERENCE_THREAD_NAME

PARTS = ("server_ms", "outside_ms", "client_wait_ms", "http_wait_ms", "inference_wait_ms")


def _run_delay_ns(fd: int) -> int | None:
    """The second field of a schedstat file: time spent runnable on a run queue."""
    try:
        return int(os.pread(fd, 128, 0).split()[1])
    except (OSError, IndexError, ValueError):  # the thread ended
        return None


class Waits:
    """The run-queue time of the client's thread and of a server process's threads by role.
    Open over the measurement, closed at its end."""

    def __init__(self, pid: int):
        self._fds: list[tuple[str, int]] = []
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):  # a thread that ended meanwhile
                name = (task / "comm").read_text().strip()
                role = "inference" if name == INFERENCE_THREAD_NAME else "http"
                self._fds.append((role, os.open(task / "schedstat", os.O_RDONLY)))
        self._client = os.open("/proc/thread-self/schedstat", os.O_RDONLY)

    def now(self) -> dict[str, int]:
        """Run-queue ns so far: the client's thread, and the server's threads by role."""
        taken = {"client": _run_delay_ns(self._client) or 0, "http": 0, "inference": 0}
        for role, fd in self._fds:
            taken[role] += _run_delay_ns(fd) or 0
        return taken

    def close(self) -> None:
        for _, fd in self._fds:
            os.close(fd)
        os.close(self._client)


def parts(ttft_ms: float, timings: dict, before: dict[str, int], after: dict[str, int]) -> dict:
    """One request's first token in parts (ms): see the module's docstring."""
    server_ms = timings["queued_ms"] + timings["ttft_ms"]

    def waited(role: str) -> float:
        return round((after[role] - before[role]) / 1e6, 2)

    return {
        "ttft_ms": round(ttft_ms, 2),
        "server_ms": round(server_ms, 2),
        "outside_ms": round(ttft_ms - server_ms, 2),
        "client_wait_ms": waited("client"),
        "http_wait_ms": waited("http"),
        "inference_wait_ms": waited("inference"),
    }


SLOWEST = 3  # requests whose parts a cell keeps whole


def summarize(requests: list[dict]) -> dict:
    """Each part's quantiles over a cell's requests, and the parts of its slowest requests
    (which part made them slow: the quantiles of each part do not say)."""
    out = {part: summary([r[part] for r in requests]) for part in PARTS}
    out["slowest"] = sorted(requests, key=lambda r: -r["ttft_ms"])[:SLOWEST]
    return out
