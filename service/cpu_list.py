"""The kernel's cpulist format ('0-1,3'), as settings carry it (CPUAffinity=, taskset -c).

Here, not in inference/host/, because the settings check a value before anything is pinned.
"""

from __future__ import annotations

import os


def parse_cpu_list(text: str) -> frozenset[int]:
    """'0-1,3' -> {0, 1, 3}, the kernel's cpulist format (as in CPUAffinity= and taskset -c)."""
    cores: set[int] = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        low, dash, high = part.partition("-")
        if not low.isdigit() or (dash and not high.isdigit()):
            raise ValueError(f"expected CPU numbers like 0-1,3, got {part!r}")
        first, last = int(low), int(high or low)
        if last < first:
            raise ValueError(f"{part!r} runs backwards")
        cores.update(range(first, last + 1))
    if not cores:
        raise ValueError("expected at least one CPU number")
    return frozenset(cores)


def cpu_list_problem(text: str) -> str | None:
    """Why `text` is not a cpulist this process may run on, or None (a Config check)."""
    try:
        cores = parse_cpu_list(text)
    except ValueError as exc:
        return str(exc)
    allowed = os.sched_getaffinity(0)
    if not cores <= allowed:
        return f"CPUs {format_cpu_list(cores - allowed)} are not available here " + (
            f"(this process may use {format_cpu_list(allowed)})"
        )
    return None


def format_cpu_list(cores) -> str:
    return ",".join(str(c) for c in sorted(cores))
