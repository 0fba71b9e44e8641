"""Side by side: xgrammar vs llguidance on the Qwen2.5 tokenizer for bench/grammar/cost's
schema: the grammar tokenizer's build, the schema's compile, and the per-token mask time
while following one valid JSON text. How the library was chosen (README "JSON answers").

xgrammar is not a dependency; install it aside, without its dependencies (torch, triton):
    pip install --no-deps --target /tmp/xg xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2
    PYTHONPATH=/tmp/xg python -m bench.grammar.libraries
"""

from __future__ import annotations

import json
import os
import statistics
import time

from bench.grammar.cost import SCHEMA
from bench.qwen_shape import fixture_dir

VOCAB = 151936  # Qwen2.5-0.5B's logits
ANSWER = {
    "title": "Printer offline on floor two",
    "category": "hardware",
    "steps": ["Check the cable", "Restart the printer", "Reinstall the driver"],
    "minutes": 15,
}


def timed(fn):
    started = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - started


def main() -> int:
    import torch
    import xgrammar as xgr
    from transformers import AutoTokenizer

    from inference.runtime.grammar import SchemaCompiler

    tok = AutoTokenizer.from_pretrained(fixture_dir(None))
    ids = tok.encode(json.dumps(ANSWER, separators=(",", ":")))
    compiler = SchemaCompiler(lambda use: use(tok), VOCAB)
    _, ll_tokenizer_s = timed(compiler.warm)
    grammar, ll_compile_s = timed(lambda: compiler.compile(SCHEMA, "bench"))
    xg_compiler, xg_tokenizer_s = timed(
        lambda: xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tok, vocab_size=VOCAB))
    )
    compiled, xg_compile_s = timed(
        lambda: xg_compiler.compile_json_schema(
            json.dumps(SCHEMA), any_whitespace=False, separators=(",", ":")
        )
    )
    times: dict[str, list[float]] = {"llguidance": [], "xgrammar": []}
    for _ in range(5):
        constraint = grammar.constraint()
        matcher = xgr.GrammarMatcher(compiled)
        bitmask = xgr.allocate_token_bitmask(1, VOCAB)
        for token in ids:
            logits = torch.randn(VOCAB)
            _, spent = timed(lambda logits=logits, c=constraint: c.mask_(logits))
            times["llguidance"].append(spent * 1000)
            assert logits[token] != float("-inf")
            constraint.take(token)
            logits = torch.randn(1, VOCAB)

            def xg_mask(logits=logits, matcher=matcher, bitmask=bitmask):
                matcher.fill_next_token_bitmask(bitmask)
                xgr.apply_token_bitmask_inplace(logits, bitmask)

            _, spent = timed(xg_mask)
            times["xgrammar"].append(spent * 1000)
            assert logits[0, token] != float("-inf") and matcher.accept_token(token)
    report = {
        "llguidance": {
            "tokenizer_build_s": round(ll_tokenizer_s, 2),
            "compile_ms": round(ll_compile_s * 1000, 1),
            "mask_ms_p50": round(statistics.median(times["llguidance"]), 3),
            "mask_ms_max": round(max(times["llguidance"]), 2),
        },
        "xgrammar": {
            "tokenizer_build_s": round(xg_tokenizer_s, 2),
            "compile_ms": round(xg_compile_s * 1000, 1),
            "mask_ms_p50": round(statistics.median(times["xgrammar"]), 3),
            "mask_ms_max": round(max(times["xgrammar"]), 2),
        },
        "tokens_followed": 5 * len(ids),
        "loadavg_1m": os.getloadavg()[0],
    }
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
