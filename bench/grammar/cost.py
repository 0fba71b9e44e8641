"""What a JSON schema costs per token: the engine with and without a constraint, in one
process, alternating request by request over the fixed prompts.

    python -m bench.grammar.cost --model qwen-shape [--rounds 5] [--max-tokens 64]

Reports the median milliseconds per decoded token on each side and their ratio, the one-off
build of the grammar tokenizer and the compile time of the schema. End-of-text is ignored on
the free side (fixed length); the constrained side ends when its JSON is complete, so its
time per token is what is compared.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from bench.models import resolve_model
from bench.prompts import CORE, PROMPTS

# Long enough for 64 tokens of output from any model: free text inside a bounded structure.
SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 60},
        "category": {"enum": ["hardware", "software", "network", "other"]},
        "steps": {"type": "array", "items": {"type": "string", "maxLength": 80}, "maxItems": 8},
        "minutes": {"type": "integer", "minimum": 0, "maximum": 600},
    },
    "required": ["title", "category", "steps", "minutes"],
    "additionalProperties": False,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.grammar.cost")
    parser.add_argument("--model", default="qwen-shape")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--fixture", default=None)
    args = parser.parse_args(argv)

    from inference.loading.assemble import ModelChoice, load_model
    from inference.runtime.budget import answer_budget
    from inference.runtime.grammar import SchemaCompiler
    from inference.runtime.jobs import Sampling
    from service.config import load_config

    config = load_config([], os.environ)
    model_dir = resolve_model(args.model, config.cache_dir, args.fixture)
    engine, prompts = load_model(ModelChoice(model_dir, model_dir.name), config, lambda _m: None)
    engine.eos_ids = set()
    compiler = SchemaCompiler(prompts.with_tokenizer, engine.vocab_size)
    started = time.perf_counter()
    compiler.warm()
    tokenizer_s = time.perf_counter() - started
    started = time.perf_counter()
    grammar = compiler.compile(SCHEMA, "bench")
    compile_ms = (time.perf_counter() - started) * 1000

    per_token: dict[str, list[float]] = {"free": [], "schema": []}
    for _ in range(args.rounds):
        for name in CORE:
            ids = prompts.encode(PROMPTS[name])
            for side, constraint in (("free", None), ("schema", grammar)):
                budget = answer_budget(len(ids), args.max_tokens, engine.context_tokens)
                sampling = Sampling(max_tokens=budget, grammar=constraint)
                t0 = time.perf_counter()
                gen = engine.run(ids, sampling, lambda _t: None, lambda: False)
                decode_s = time.perf_counter() - t0 - gen.ttft_s
                if gen.completion_tokens > 1:
                    per_token[side].append(decode_s * 1000 / (gen.completion_tokens - 1))
    free = statistics.median(per_token["free"])
    constrained = statistics.median(per_token["schema"])
    report = {
        "model": str(model_dir),
        "ms_per_token_free_p50": round(free, 2),
        "ms_per_token_schema_p50": round(constrained, 2),
        "ratio": round(constrained / free, 3),
        "grammar_tokenizer_build_s": round(tokenizer_s, 2),
        "schema_compile_ms": round(compile_ms, 2),
        "runs_per_side": len(per_token["free"]),
        "loadavg_1m": os.getloadavg()[0],
    }
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
