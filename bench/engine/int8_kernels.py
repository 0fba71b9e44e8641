"""Integer GEMM kernels for the per-row int8 Linear at few rows: which is fastest, and which
give bitwise the same output as the one served (inference/quant/rowint8.py).

    python -m bench.engine.int8_kernels [--threads 2] [--rows 1,2,4,8]

Why: with continuous batching the decode step runs 1-8 rows, and a lone user should not pay
for the batch invariance. The integer product is exact, so any kernel that gives
the same int32 sums and is followed by the same float ops keeps a row's answer the same in
any batch. For each Qwen2.5-0.5B projection shape and row count it prints the median
microseconds per call of each candidate, the scaling of the input rows included (it is also
timed alone), and whether its output equals the served one's bit for bit (torch.ao
quantizes differently: its equality is not asked). This is how fbgemm replaced oneDNN.
Without VNNI (7-bit rows) oneDNN's product is not exact: `same` is false there.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from inference.quant import rowint8

# Qwen2.5-0.5B's projections as the per-row path runs them: (out, in) features.
SHAPES = {"qkv": (1152, 896), "o": (896, 896), "gate_up": (9728, 896), "down": (896, 4864)}


# Candidates whose output is not the same product: torch.ao quantizes the activations its
# own way, and the quantization alone is there for its cost.
NOT_COMPARED = ("torch.ao fbgemm (not per-row)", "scale_rows alone")
SERVED = "served (fbgemm, per-row)"


def per_call_us(f, calls: int = 24, rounds: int = 7) -> float:
    f()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            f()
        times.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(times)


def candidates(weight: torch.Tensor, x: torch.Tensor) -> dict:
    """name -> a call computing x @ weight.T the way that candidate does."""
    served = rowint8.RowInt8Linear.from_weight(weight)
    limit = served.limit
    qw, w_scale = rowint8.quantize_weight(weight)
    zeros = torch.zeros(weight.shape[0], dtype=torch.int64)
    onednn_one_row = torch.ops.onednn.qlinear_prepack(qw, [1, weight.shape[1]])
    onednn_any_m = torch.ops.onednn.qlinear_prepack(qw, None)
    qw_t, qw_t_contiguous = qw.t(), qw.t().contiguous()
    ao = torch.ao.nn.quantized.dynamic.Linear(weight.shape[1], weight.shape[0])
    with rowint8.fbgemm_engine():
        ao.set_weight_bias(
            torch.quantize_per_channel(weight, w_scale.double(), zeros, 0, torch.qint8), None
        )

    def onednn(packed):
        scaled, row_scale = rowint8.scale_rows(x, limit)
        y = torch.ops.onednn.qlinear_pointwise(
            scaled.to(torch.int8),
            *(1.0, 0, packed, w_scale, zeros, None, 1.0, 0, torch.float32, "none", [], ""),
        )
        return y.mul_(row_scale)

    def int_mm(b):
        scaled, row_scale = rowint8.scale_rows(x, limit)
        return torch._int_mm(scaled.to(torch.int8), b).float().mul_(w_scale).mul_(row_scale)

    return {
        SERVED: lambda: served(x),
        "oneDNN packed for one row": lambda: onednn(onednn_one_row),
        "oneDNN packed for any M": lambda: onednn(onednn_any_m),
        "_int_mm, [K,N] contiguous": lambda: int_mm(qw_t_contiguous),
        "_int_mm, transposed view": lambda: int_mm(qw_t),
        "torch.ao fbgemm (not per-row)": lambda: ao(x),
        "scale_rows alone": lambda: rowint8.scale_rows(x, limit),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.engine.int8_kernels", description=__doc__
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", default="1,2,4,8")
    parser.add_argument("--calls", type=int, default=24, help="per timing round")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    results = []
    with torch.inference_mode():
        for shape, (n, k) in SHAPES.items():
            weight = torch.randn(n, k, generator=gen) * 0.02
            for m in (int(r) for r in args.rows.split(",")):
                x = torch.randn(m, k, generator=gen)
                calls = candidates(weight, x)
                want = calls[SERVED]()
                for name, call in calls.items():
                    same = None if name in NOT_COMPARED else torch.equal(call(), want)
                    us = round(per_call_us(call, args.calls), 1)
                    results.append(
                        {"shape": shape, "rows": m, "kernel": name, "us": us, "same": same}
                    )
                    print(json.dumps(results[-1]), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
