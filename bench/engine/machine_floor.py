"""The machine's floor for the latency table: how steady fixed work is on this PC right now.

    python -m bench.engine.machine_floor [--ms 8 | --repeats N] [--seconds 10] [--threads N]

Why: a token gap's p99/p50 on a quiet PC is partly the server's and partly the machine's
(a VM's host, interrupts, the CPU's clocks). This times a fixed loop made of what a decode
step is made of, the native int8 product of one row through a 4,096 x 576 weight (the
embedded model's width; it stays in the cache), on as many threads as the server's default
(the physical cores), repeated so that one sample lasts about `--ms` (the quiet gap it
is compared with). No HTTP, no queue: between two calls only the loop's own Python. It
prints one JSON line: the samples' summary (bench/stats.py, `jitter` = p99/p50), the
repeats a sample, the thread count and the nice it ran at. `python -m bench --latency`
runs it after each cell, in a process started as the server is (its own session, the
setting's priority and scheduler slice): after the quiet cell with samples as long
as its gap p50, and beside a noise condition, while the noise still runs, with the quiet
floor's repeats: the same work, so what the noise does to fixed work shows beside what it
does to the server's gaps.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from bench.launcher import ROOT, Setting, prioritize
from bench.stats import summary
from inference.host.process import set_slice
from service.config import load_config, physical_cores

START_S = 120.0  # beside()'s process may take this long to start (torch, the native library)
ROWS, WIDTH = 4096, 576  # the embedded model's width (576); the weight (2.4 MB) stays in cache


def product(threads: int):
    """A call of the native int8 product on fixed operands, on `threads` threads."""
    import torch

    from inference.native import build, library

    torch.set_num_threads(threads)
    lib = library.load(tuple(build.runnable_here()))
    if lib is None:
        raise SystemExit("no native build runs here: the floor needs one")
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(-127, 128, (ROWS, WIDTH), dtype=torch.int8, generator=gen)
    scale = torch.rand(ROWS, generator=gen).add_(0.5).div_(100)
    x = torch.randn(1, WIDTH, generator=gen)
    return lambda: lib.linear(q, scale, None, x)


def repeats_for(call, ms: float) -> int:
    """How many calls make one sample of about `ms` (timed on 200 calls after a warm-up)."""
    for _ in range(50):
        call()
    start = time.perf_counter()
    for _ in range(200):
        call()
    per_call_ms = (time.perf_counter() - start) * 1000 / 200
    return max(1, round(ms / per_call_ms))


def measure(call, repeats: int, seconds: float) -> list[float]:
    """Samples (ms) of `repeats` calls each, for `seconds`."""
    samples = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        start = time.perf_counter()
        for _ in range(repeats):
            call()
        samples.append((time.perf_counter() - start) * 1000)
    return samples


def beside(chosen: Setting, ms: float, seconds: float, repeats: int | None = None) -> dict:
    """The floor measured in a process started as `chosen`'s server is: its own session,
    its priority and environment; samples of about `ms`, or of `repeats` calls (another
    run's, so that their samples are the same work). {sample_ms, repeats, threads, nice} or
    {error}."""
    command = [sys.executable, "-m", "bench.engine.machine_floor", "--ms", f"{ms:g}"]
    command += ["--sched-slice-us", str(chosen.slice_us())]
    if repeats:
        command += ["--repeats", str(repeats)]
    try:
        done = subprocess.run(
            [*command, "--seconds", f"{seconds:g}"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            env={**os.environ, **chosen.env},
            start_new_session=True,
            preexec_fn=prioritize(chosen.nice),
            timeout=seconds + START_S,
        )
    except subprocess.TimeoutExpired:
        return {"error": f"no result in {seconds + START_S:g} s"}
    if done.returncode:
        return {"error": (done.stderr.strip().splitlines() or ["no output"])[-1][:200]}
    return json.loads(done.stdout.splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.engine.machine_floor", description=__doc__
    )
    parser.add_argument("--ms", type=float, default=8.0, help="one sample's length")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--threads", type=int, default=physical_cores(), help="[the server's]")
    parser.add_argument(
        "--repeats", type=int, help="calls a sample, instead of --ms: another run's, to compare"
    )
    parser.add_argument(
        "--sched-slice-us",
        type=int,
        default=load_config([], os.environ).sched_slice_us,
        help="the scheduler slice to ask for, as the server's --sched-slice-us [its default]",
    )
    args = parser.parse_args(argv)
    if args.ms <= 0 or args.seconds <= 0 or args.threads < 1:
        parser.error("--ms and --seconds must be positive, --threads 1 or more")
    if args.repeats is not None and args.repeats < 1:
        parser.error("--repeats must be 1 or more")
    set_slice(args.sched_slice_us)  # started as the server is: its slice too
    call = product(args.threads)
    repeats = args.repeats or repeats_for(call, args.ms)
    samples = measure(call, repeats, args.seconds)
    nice = os.getpriority(os.PRIO_PROCESS, 0)
    print(
        json.dumps(
            {
                "sample_ms": summary(samples),
                "repeats": repeats,
                "threads": args.threads,
                "nice": nice,
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
