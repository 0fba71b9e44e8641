"""How long Python's garbage collector stops the inference thread, per generation, and how
many of those stops fall inside a job; under each --gc-policy (inference/host/process.py).

    python -m bench.serving.gc_pauses [--model qwen-shape|embedded|DIR] [--requests 20]

Loads the engine in this process as the server would (DESKCHAT_* settings), times one full
collection before and after the policy, runs the requests one after another as the worker
does (between_jobs() between them), and times every collection through gc.callbacks.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from pathlib import Path

from bench.prompts import PROMPTS
from bench.stats import percentile


class PauseClock:
    """gc.callbacks that time each collection and note whether a job was running."""

    def __init__(self):
        self.pauses: list[tuple[int, float, bool]] = []  # generation, ms, inside a job
        self.in_job = False
        self._started = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            ms = (time.perf_counter() - self._started) * 1000
            self.pauses.append((info["generation"], ms, self.in_job))

    def report(self) -> dict:
        out = {}
        for generation in range(3):
            ms = [p[1] for p in self.pauses if p[0] == generation]
            inside = [p[1] for p in self.pauses if p[0] == generation and p[2]]
            out[f"gen{generation}"] = {
                "count": len(ms),
                "inside_jobs": len(inside),
                "p50_ms": round(percentile(ms, 50), 3),
                "p99_ms": round(percentile(ms, 99), 3),
                "max_ms": round(max(ms), 3) if ms else 0.0,
                "max_inside_job_ms": round(max(inside), 3) if inside else 0.0,
            }
        return out


def _timed_full_collection() -> float:
    """Milliseconds of one full collection now (the best of three)."""
    times = []
    for _ in range(3):
        started = time.perf_counter()
        gc.collect()
        times.append((time.perf_counter() - started) * 1000)
    return round(min(times), 2)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.serving.gc_pauses", description=__doc__)
    parser.add_argument("--model", default="qwen-shape")
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args(argv)

    from bench.models import resolve_model
    from inference.host.process import apply_gc_policy, between_jobs
    from inference.loading.assemble import ModelChoice, load_model
    from inference.runtime.jobs import Sampling
    from service.config import load_config

    config = load_config([], os.environ)
    model_dir = resolve_model(args.model, config.cache_dir, None)
    engine, prompts = load_model(ModelChoice(Path(model_dir), model_dir.name), config, print)
    engine.eos_ids = set()  # every answer max_tokens long
    ids = [prompts.encode(m) for m in PROMPTS.values()]
    engine.run(ids[0], Sampling(max_tokens=8), lambda _t: None, lambda: False)  # warm-up
    full_ms = {"before_policy": _timed_full_collection()}
    apply_gc_policy(config.gc_policy)
    full_ms["after_policy"] = _timed_full_collection()
    clock = PauseClock()
    gc.callbacks.append(clock)
    for n in range(args.requests):
        between_jobs(queued=0)
        clock.in_job = True
        engine.run(
            ids[n % len(ids)], Sampling(max_tokens=args.max_tokens), lambda _t: None, lambda: False
        )
        clock.in_job = False
    gc.callbacks.remove(clock)
    result = {"gc_policy": config.gc_policy, "model": str(model_dir), **clock.report()}
    result["full_collection_ms"] = full_ms  # what one oldest-generation pause costs
    result["loadavg_1m"] = round(os.getloadavg()[0], 2)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
