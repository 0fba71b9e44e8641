"""Forward CPU time of each path this CPU can run (fp32, int8 on every torch.ao engine that
inference/host/cpu.py deems safe here, int4), all loaded in this process and run interleaved,
one thread, `time.thread_time`: ratios to fp32 on the same CPU, emulated or not.

    python -m bench.engine.cpu_paths [--model DIR|embedded] [--steps N]
    qemu-x86_64 -cpu SandyBridge .venv/bin/python -m bench.engine.cpu_paths   (emulated: only the
        ratios mean anything)

Decode steps over a 32-token context and a 32-token prefill; medians in ms, printed as one
JSON object with the CPU's plan.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from bench.engine.int8_steps import cpu_ms
from inference.host import cpu
from inference.loading.checkpoint import load_quantized
from inference.quant import smooth


def load_paths(folder: Path, plan: cpu.Plan, int4: bool = True) -> dict:
    """fp32, then int8 on each safe engine, then int4 where it is known to work (and
    wanted: below AVX2 its kernel is scalar, hours under emulation)."""
    tok = AutoTokenizer.from_pretrained(folder)
    cal = tok(smooth.CALIBRATION_TEXT, return_tensors="pt")["input_ids"]
    models = {"fp32": AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()}
    for engine in cpu.int8_engines(plan.paths.isa, cpu.detect().engines):
        torch.backends.quantized.engine = engine  # packed weights keep the engine they had
        models[f"int8 {engine}"] = load_quantized(folder, "int8", "auto", cal)
    if int4 and plan.paths.int4 != cpu.NONE:
        models["int4"] = load_quantized(folder, "int4", "auto", cal)
    return models


def measure(models: dict, steps: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    vocab = next(iter(models.values())).config.vocab_size
    context = torch.randint(0, vocab, (1, 32), generator=gen)
    step = torch.randint(0, vocab, (1, 1), generator=gen)
    decode = {name: [] for name in models}
    prefill = {name: [] for name in models}
    with torch.inference_mode():
        caches = {}
        for name, m in models.items():
            caches[name] = DynamicCache(config=m.config)
            m(input_ids=context, cache=caches[name], use_cache=True, logits_to_keep=1)
        for _ in range(steps):
            for name, m in models.items():
                c = caches[name]
                decode[name].append(cpu_ms(lambda m=m, c=c: m(input_ids=step, cache=c)))
                c.crop(-1)
        for _ in range(max(2, steps // 3)):
            for name, m in models.items():
                prefill[name].append(cpu_ms(lambda m=m: m(input_ids=context, logits_to_keep=1)))
    out = {}
    for name in models:
        d, p = statistics.median(decode[name]), statistics.median(prefill[name])
        out[name] = {"decode_ms": round(d, 1), "prefill32_ms": round(p, 1)}
    base = out["fp32"]
    for row in out.values():
        row["decode_vs_fp32"] = round(base["decode_ms"] / row["decode_ms"], 2)
        row["prefill_vs_fp32"] = round(base["prefill32_ms"] / row["prefill32_ms"], 2)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="embedded", help="a model folder or 'embedded'")
    parser.add_argument("--steps", type=int, default=6, help="decode steps per path")
    parser.add_argument("--no-int4", action="store_true", help="leave int4 out")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.model == "embedded":
        from inference.loading.embedded import embedded_model_dir
        from service.config import default_cache_dir

        folder = embedded_model_dir(default_cache_dir())
    else:
        folder = Path(args.model).expanduser()
    plan = cpu.plan_here("int8")
    print(plan.summary(), flush=True)
    results = measure(load_paths(folder, plan, int4=not args.no_int4), args.steps)
    print(json.dumps({"plan": plan.as_dict(), "paths": results}, indent=1))


if __name__ == "__main__":
    main()
