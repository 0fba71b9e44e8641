"""Where one decode step's time goes: the engine's own step under torch.profiler.

    python -m bench.engine.step_profile [--model qwen-shape|embedded|DIR] [--batch 1,4] [--steps 32]

Why ("profile first"): the levers to try depend on the split between the int8
GEMMs, the row scaling around them, attention, the other small ops, and what is outside any
op (Python, dispatch, sampling and detokenizing in the engine). For each batch size B it
opens B streams on one prompt, lets them decode, and profiles `--steps` steps of
`engine.step`; it prints per step: the wall time without the profiler, the same under it, and
each category's self CPU time of the calling thread (an op's time on the OpenMP workers is
inside its caller's), plus the ops that cost most. The rest of the profiled wall time is
"outside ops". The profiler adds about a microsecond per op, which lands there.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import time

# Categories by op name, first match wins. The row scaling of the per-row int8 Linear is
# abs + amax + clamp + mul/div + round around each GEMM: counted as elementwise with the rest,
# since the names do not say which module called them. "sampling" lists only ops the engine's
# sampler alone uses (engine._pick); its multiply and compare count as elementwise too.
ATTENTION = r"scaled_dot_product|flash_attention"
CATEGORIES = [
    ("native step", r"^deskchat::native_step$"),  # the whole forward in C (inference/native)
    ("int8 GEMM", r"^quantized::|^onednn::"),
    ("attention", ATTENTION),
    ("float GEMM", r"^aten::(linear|addmm|mm|bmm|matmul)$"),
    ("embedding", r"^aten::(embedding|index_select)$"),
    (
        "copies and layout",
        r"^aten::(copy_|_to_copy|to|cat|contiguous|clone|index_copy_|"
        r"slice_scatter|narrow_copy|empty|empty_like|zeros|full|as_strided|view|reshape|"
        r"transpose|permute|expand|slice|select|unsqueeze|squeeze|split|t|_unsafe_view|"
        r"detach|alias|split_with_sizes|resize_|set_|stack)$",
    ),
    (
        "sampling",
        r"^aten::(softmax|_softmax|log_softmax|_log_softmax|argmax|topk|sort|multinomial|"
        r"cumsum)$",
    ),
    ("elementwise and norms", r"^aten::"),
]


def attributed_name(event) -> str:
    """The op's name, or its attention ancestor's: the matmuls and softmax inside
    scaled_dot_product_attention are attention, not GEMM or sampling."""
    parent = event.cpu_parent
    while parent is not None:
        if re.search(ATTENTION, parent.name):
            return parent.name
        parent = parent.cpu_parent
    return event.name


def category(name: str) -> str:
    for label, pattern in CATEGORIES:
        if re.search(pattern, name):
            return label
    return "other"


def profile_batch(engine, prompt_ids, batch: int, steps: int) -> dict:
    """Open `batch` streams, prefill them, then time `steps` steps plain and `steps` under
    the profiler; answers are long enough for both."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from inference.runtime.budget import answer_budget
    from inference.runtime.jobs import Sampling

    budget = answer_budget(len(prompt_ids), 2 * steps + 16, engine.context_tokens)
    streams = [engine.open(prompt_ids, Sampling(max_tokens=budget)) for _ in range(batch)]
    while any(s.completion_tokens == 0 for s in streams):  # prompts read, first tokens out
        engine.step(streams)
    plain = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step(streams)
        plain.append((time.perf_counter() - start) * 1000)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step(streams)
        profiled_ms = (time.perf_counter() - start) * 1000 / steps
    for stream in streams:
        engine.close(stream)
    per_step: dict[str, float] = {}
    ops: dict[str, list] = {}
    for event in prof.events():
        ms = event.self_cpu_time_total / 1000 / steps
        label = category(attributed_name(event))
        per_step[label] = per_step.get(label, 0.0) + ms
        op = ops.setdefault(event.name, [0.0, 0])
        op[0] += ms
        op[1] += 1
    inside = sum(per_step.values())
    split = {k: round(v, 2) for k, v in sorted(per_step.items(), key=lambda kv: -kv[1])}
    split["outside ops (Python, dispatch, profiler)"] = round(profiled_ms - inside, 2)
    top = [
        {"op": name, "ms": round(ms, 2), "calls": round(calls / steps, 1)}
        for name, (ms, calls) in sorted(ops.items(), key=lambda kv: -kv[1][0])[:12]
    ]
    return {
        "batch": batch,
        "decode_step": engine.decode_step,
        "steps": steps,
        "threads": torch.get_num_threads(),
        "step_ms_plain_p50": round(statistics.median(plain), 2),
        "step_ms_profiled": round(profiled_ms, 2),
        "split_ms": split,
        "top_ops": top,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.engine.step_profile", description=__doc__
    )
    parser.add_argument("--model", default="qwen-shape")
    parser.add_argument("--threads", type=int, default=None, help="[default: the server's]")
    parser.add_argument("--batch", default="1,4", help="streams decoding side by side")
    parser.add_argument("--steps", type=int, default=32)
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be 1 or more")

    from bench.engine.step_jitter import engine_and_prompt

    engine, prompt_ids, threads = engine_and_prompt(args.model, args.threads)
    load_before = os.getloadavg()[0]
    for batch in (int(b) for b in args.batch.split(",")):
        report = profile_batch(engine, prompt_ids, batch, args.steps)
        report["load_1m"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
        print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
