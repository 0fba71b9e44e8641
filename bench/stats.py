"""Percentiles, the per-side summary of the side-by-side table, and the latency summary
(p50 ... p99.9, max, p99/p50) of a list of milliseconds."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

SUMMARY_KEYS = (
    "ttft_ms_p50",
    "ttft_ms_p90",
    "decode_tok_s_p50",
    "e2e_s_p50",
    "peak_rss_mb",
    "load_s",
)
QUANTILES = (50, 90, 99, 99.9)  # the latency summary's


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in 0..100), like numpy's default; NaN when empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def peak_rss_mb(pid: int | str = "self") -> float:
    """A process's own peak (VmHWM of /proc/PID/status), NaN without it. Not ru_maxrss: that
    keeps the parent's high-water mark across fork and exec (every side of a bench once
    reported its parent's 1,576 MB)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return math.nan
    for line in status.splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024  # kB
    return math.nan


def summarize(runs: list[dict], peak_rss_mb: float, load_s: float) -> dict:
    """One side's numbers from its runs ({ttft_ms, decode_tok_s, e2e_s, ...} each)."""
    ttft = [r["ttft_ms"] for r in runs]
    return {
        "ttft_ms_p50": round(percentile(ttft, 50), 1),
        "ttft_ms_p90": round(percentile(ttft, 90), 1),
        "decode_tok_s_p50": round(percentile([r["decode_tok_s"] for r in runs], 50), 2),
        "e2e_s_p50": round(percentile([r["e2e_s"] for r in runs], 50), 3),
        "peak_rss_mb": round(peak_rss_mb, 1),
        "load_s": round(load_s, 2),
    }


def summary(values: list[float]) -> dict:
    """p50 ... p99.9, max and p99/p50 of a list of milliseconds."""
    out = {f"p{q:g}": round(percentile(values, q), 1) for q in QUANTILES}
    out["max"] = round(max(values), 1) if values else float("nan")
    out["jitter"] = round(out["p99"] / out["p50"], 2) if values and out["p50"] else float("nan")
    out["n"] = len(values)
    return out
