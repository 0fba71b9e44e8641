"""The decode-step times of the engine alone in this process: no HTTP, no queue, no noise.

    python -m bench.engine.step_jitter [--model qwen-shape|embedded|DIR] [--threads N] [--answers 8]
                                      [--noise cpu|bursts] [--prefill]

Why: the latency table (`python -m bench --latency`) measures gaps through the server; this
says how much of their spread the machine itself adds with nothing else involved. It prints
the latency table's summary (p50 ... p99.9, max, `jitter` = p99/p50) of the wall time of
each step after the first token, the same for the thread's CPU time (equal to the wall time
when the thread was never descheduled: then the spread comes from below the OS, e.g. a VM's
host), and the 1-minute load average. `--noise cpu` runs the steps beside one busy process per
CPU (bench/serving/noise.py's condition): the step's own loss to a busy PC, without the HTTP
and the client that the latency bench adds. `--prefill` times each answer's first step (its
prompt's, most of a first token's time in the engine) instead of the steps after it. The
engine runs as in the server: its scheduler slice (DESKCHAT_SCHED_SLICE_US, as the server
reads it) and its thread count set after the load (docs/latency.md says what it measured
before it did).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from pathlib import Path

from bench.stats import summary


def engine_and_prompt(model: str, threads: int | None) -> tuple:
    """(engine, prompt ids, threads): the server's engine on `model` with its settings (the
    thread count replaced when given) and its thread count set as server.py sets it after
    the load (the native pool's, and torch's ops beside it on one thread, not an OpenMP pool
    of their own), answers never ending early, and one coding question."""
    from bench.models import resolve_model
    from inference.loading.assemble import ModelChoice, load_model
    from service.config import load_config

    config = load_config([], os.environ)
    if threads:
        config = dataclasses.replace(config, threads=threads)
    folder = Path(resolve_model(model, config.cache_dir, None))
    engine, prompts = load_model(ModelChoice(folder, folder.name), config, lambda _m: None)
    engine.set_threads(config.threads)
    engine.eos_ids = set()  # every answer max_tokens long
    ask = "Write a Python function that parses a CSV file, and explain it."
    return engine, prompts.encode([{"role": "user", "content": ask}]), config.threads


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.engine.step_jitter", description=__doc__)
    parser.add_argument("--model", default="qwen-shape")
    parser.add_argument("--threads", type=int, default=None, help="[default: the server's]")
    parser.add_argument("--answers", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--noise", choices=("quiet", "cpu", "bursts"), default="quiet")
    parser.add_argument("--prefill", action="store_true", help="time the prompts' steps")
    args = parser.parse_args(argv)
    if args.max_tokens < 2 or args.answers < 1:
        parser.error(
            "--max-tokens must be 2 or more (a decode step after the first token), "
            "--answers 1 or more"
        )

    from bench.serving.noise import Noise
    from inference.host.process import set_slice
    from inference.runtime.budget import answer_budget
    from inference.runtime.jobs import Sampling
    from service.config import load_config

    set_slice(load_config([], os.environ).sched_slice_us)  # the server's, for this run
    try:
        engine, prompt_ids, threads = engine_and_prompt(args.model, args.threads)
        budget = answer_budget(len(prompt_ids), args.max_tokens, engine.context_tokens)
        wall, cpu = [], []
        load_before = os.getloadavg()[0]
        with Noise(args.noise, seconds=3600):
            for _ in range(args.answers):
                answer(engine, prompt_ids, Sampling(max_tokens=budget), wall, cpu, args.prefill)
    finally:
        set_slice(0)
    report = {
        "threads": threads,
        "noise": args.noise,
        "timed": "prefill" if args.prefill else "decode steps",
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "(unset)"),
        "steps": len(wall),
        "load_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
    }
    report["wall_ms"], report["cpu_ms"] = summary(wall), summary(cpu)
    print(json.dumps(report))
    return 0


def answer(engine, prompt_ids, sampling, wall: list, cpu: list, prefill: bool = False) -> None:
    """One answer, its decode steps' wall and CPU milliseconds appended (or its prefill's
    alone: the first step)."""
    stream = engine.open(prompt_ids, sampling)
    first = True
    while stream.finish is None:
        start, start_cpu = time.perf_counter(), time.thread_time()
        engine.step([stream])
        if first == prefill:
            wall.append((time.perf_counter() - start) * 1000)
            cpu.append((time.thread_time() - start_cpu) * 1000)
        first = False
    engine.close(stream)


if __name__ == "__main__":
    raise SystemExit(main())
