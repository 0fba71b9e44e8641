"""Where a first token's time goes: the server's own part and the threads that waited for a
CPU meanwhile, read per request by the latency bench when it started the server itself.

From the request's start to its first text event: the server's queue and first step (its
`queued_ms + ttft_ms`), everything else (the request's way in, Flask, the template and
tokenizer, the first event's way out to the client), and the run-queue time
(/proc/.../schedstat) of the measuring client's thread, of the server's inference threads
(`deskchat-infer`: the inference thread and the native step's pool) and of its other threads
(the HTTP threads, main). A wait is summed over a role's threads, so two threads waiting
2 ms at once count 4 ms; the kernel adds a wait when it ends, so one still going at a
reading counts at the next. The server's threads are listed once, when the measurement
opens (a server's threads are all started by then); each one's file is opened once and read
with pread: a reading costs tens of microseconds, taken before the request and after its
first event has been timed.
"""

from __future__ import annotations

import contextlib
import heapq
import os
from operator import itemgetter
from pathlib import Path

from bench.stats import summary
from inference.host.process import INFERENCE_THREAD_NAME

ROLES = ("client", "http", "inference")
PARTS = ("server_ms", "outside_ms", *(f"{role}_wait_ms" for role in ROLES))
SLOWEST = 3  # requests whose parts a cell keeps whole


def _run_delay_ns(fd: int) -> int | None:
    """The second field of a schedstat file: time spent runnable on a run queue."""
    try:
        return int(os.pread(fd, 128, 0).split()[1])
    except (OSError, IndexError, ValueError):  # the thread ended
        return None


class Waits:
    """The run-queue time of the client's thread and of a server process's threads by role:
    `with Waits(pid) as waits: waits.now()`."""

    def __init__(self, pid: int):
        self._fds: list[tuple[str, int]] = []
        self._last: dict[int, int] = {}  # a thread that ends keeps what it waited
        try:
            for task in Path(f"/proc/{pid}/task").iterdir():
                with contextlib.suppress(OSError):  # a thread that ended meanwhile
                    name = (task / "comm").read_text().strip()
                    role = "inference" if name == INFERENCE_THREAD_NAME else "http"
                    self._fds.append((role, os.open(task / "schedstat", os.O_RDONLY)))
            self._fds.append(("client", os.open("/proc/thread-self/schedstat", os.O_RDONLY)))
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> Waits:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def now(self) -> dict[str, int]:
        """Run-queue ns so far, by role: the client's thread, the server's threads."""
        taken = dict.fromkeys(ROLES, 0)
        for role, fd in self._fds:
            delay = _run_delay_ns(fd)
            if delay is not None:
                self._last[fd] = delay
            taken[role] += self._last.get(fd, 0)
        return taken

    def close(self) -> None:
        for _, fd in self._fds:
            os.close(fd)
        self._fds = []


def parts(ttft_ms: float, timings: dict, before: dict[str, int], after: dict[str, int]) -> dict:
    """One request's first token in parts (ms): see the module's docstring."""
    server_ms = timings["queued_ms"] + timings["ttft_ms"]
    waited = {f"{r}_wait_ms": round((after[r] - before[r]) / 1e6, 2) for r in ROLES}
    return {
        "ttft_ms": round(ttft_ms, 2),
        "server_ms": round(server_ms, 2),
        "outside_ms": round(ttft_ms - server_ms, 2),
        **waited,
    }


def summarize(requests: list[dict]) -> dict:
    """Each part's quantiles over a cell's requests, and the parts of its slowest requests
    (which part made them slow: the quantiles of each part do not say)."""
    out = {part: summary([r[part] for r in requests]) for part in PARTS}
    out["slowest"] = heapq.nlargest(SLOWEST, requests, key=itemgetter("ttft_ms"))
    return out


def table_lines(cells: dict) -> list[str]:
    """The latency report's table of first tokens, for the cells that measured them: each
    part's p50 / p90 / p99, and the parts of the slowest requests."""
    rows = [
        (label, condition, cell["first_token"])
        for label, row in cells.items()
        for condition, cell in row.items()
        if "first_token" in cell
    ]
    if not rows:
        return []
    lines = [
        "",
        "First token, ms p50 / p90 / p99: the server's queue and first step; the rest (the "
        "request's way in, the first event's way out); run-queue waits meanwhile of the "
        "client, the server's HTTP and other threads, and its inference threads (summed over "
        "threads); the slowest requests as TTFT = server + rest (waits client, HTTP and "
        "others, inference)",
        "",
        "| setting | condition | server | rest | client waits | HTTP and other threads wait "
        "| inference threads wait | slowest |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for label, condition, measured in rows:
        quants = [" / ".join(f"{measured[p][q]:g}" for q in ("p50", "p90", "p99")) for p in PARTS]
        slowest = ", ".join(
            f"{r['ttft_ms']:.1f} = {r['server_ms']:.1f} + {r['outside_ms']:.1f} ("
            + ", ".join(f"{r[f'{role}_wait_ms']:.1f}" for role in ROLES)
            + ")"
            for r in measured["slowest"]
        )
        lines.append(f"| {label} | {condition} | " + " | ".join(quants) + f" | {slowest} |")
    return lines
