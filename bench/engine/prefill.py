"""Prefill time against prompt length, in this process: what `--max-prompt-tokens` rests on.

`python -m bench.engine.prefill --model embedded` (or `--model qwen-shape`, or a model folder)
loads the engine with the DESKCHAT_* settings of the environment, then runs prompts of
growing length (a system text of repeated sentences plus one question), one answer token
each, and prints one JSON line per length: prompt tokens, prefill (TTFT) seconds per run,
and prompt tokens per second; then the 1-minute load average before and after. The prefix
cache is emptied before each run: every run computes its whole prompt.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from bench.models import resolve_model

FILLER = "The quarterly report lists every printer, its toner level and the room it is in. "


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.engine.prefill", description=__doc__)
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument("--lengths", default="256,512,1024,2048,4000")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args(argv)

    from inference.loading.assemble import ModelChoice, load_model
    from inference.runtime.budget import answer_budget
    from inference.runtime.jobs import Sampling
    from service.config import load_config

    env = dict(os.environ)
    if args.cache_dir:
        env["DESKCHAT_CACHE_DIR"] = args.cache_dir
    config = load_config([], env)
    folder = resolve_model(args.model, config.cache_dir, None)
    engine, prompts = load_model(ModelChoice(folder, folder.name), config, lambda _m: None)
    warm_up = prompts.encode([{"role": "user", "content": "Hi"}])
    engine.run(warm_up, Sampling(max_tokens=1), lambda _t: None, lambda: False)
    load_before = os.getloadavg()[0]
    head = {"model": folder.name, "quantize": config.quantize, "loadavg_1m": load_before}
    print(json.dumps(head), flush=True)
    for wanted in (int(n) for n in args.lengths.split(",")):
        system = FILLER * (wanted // 15 + 1)
        messages = [{"role": "user", "content": "Which room has the printer?"}]
        ids = prompts.encode(messages, system)
        ids = ids[-wanted:] if len(ids) > wanted else ids
        times = []
        for _ in range(args.runs):
            if engine.prefixes is not None:  # each run computes the whole prompt
                engine.prefixes.clear()
            started = time.perf_counter()
            budget = answer_budget(len(ids), 1, engine.context_tokens)  # 0 if ids fill it
            gen = engine.run(ids, Sampling(max_tokens=budget), lambda _t: None, lambda: False)
            times.append(gen.ttft_s if gen.ttft_s > 0 else time.perf_counter() - started)
        p50 = statistics.median(times)
        row = {
            "prompt_tokens": len(ids),
            "prefill_s": [round(t, 3) for t in times],
            "prefill_s_p50": round(p50, 3),
            "prompt_tok_s": round(len(ids) / p50, 1),
            "loadavg_1m": round(os.getloadavg()[0], 2),
        }
        print(json.dumps(row), flush=True)
    print(json.dumps({"loadavg_1m_before": load_before, "loadavg_1m_after": os.getloadavg()[0]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
