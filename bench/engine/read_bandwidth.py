"""How fast this PC reads memory: the ceiling of a decode step, which reads every weight once.

    python -m bench.engine.read_bandwidth [--gib 2] [--threads 1,2] [--repeats 7]

Why: a one-user decode rate is bounded by (read bandwidth) / (weight bytes a token), for
deskchat and llama.cpp alike (docs/speed.md, "Why one user on the 1.5B shape is bound near
1.0x"). torch sums a float32 buffer far larger than the caches on each thread count; that
reads at about the rate of a hand-written AVX2 loop on the 2-core EPYC VM (33.0-34.9 against
34.4-34.5 GB/s at two threads, 2026-12-05). Prints one JSON line per thread count (median
and best GB/s of the repeats) and the load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch


def read_rates(buffer: torch.Tensor, threads: int, repeats: int) -> list[float]:
    """GB/s of each of `repeats` full reads of `buffer` on `threads` threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        rates = []
        for _ in range(repeats):
            start = time.perf_counter()
            buffer.sum()
            rates.append(
                buffer.numel() * buffer.element_size() / (time.perf_counter() - start) / 1e9
            )
        return rates
    finally:
        torch.set_num_threads(before)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.engine.read_bandwidth", description=__doc__
    )
    parser.add_argument(
        "--gib", type=float, default=2.0, help="buffer size (GiB), past every cache"
    )
    parser.add_argument("--threads", default="1,2", help="thread counts, comma-separated")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    buffer = torch.ones(int(args.gib * (1 << 30)) // 4)  # float32, its pages touched once
    print(json.dumps({"loadavg_1m_before": os.getloadavg()[0]}))
    for threads in (int(t) for t in args.threads.split(",")):
        rates = read_rates(buffer, threads, args.repeats)
        median, best = statistics.median(rates), max(rates)
        print(
            json.dumps(
                {"threads": threads, "median_gb_s": round(median, 1), "best_gb_s": round(best, 1)}
            )
        )
    print(json.dumps({"loadavg_1m_after": os.getloadavg()[0]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
