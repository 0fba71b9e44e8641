"""How far the int8 GEMMs alone are from llama.cpp's whole decode step, in one process.

    python -m bench.engine.gemm_floor [--model qwen-shape|DIR] [--blocks 6] [--steps 64]

Why: decode at 1.2x llama.cpp needs the engine's step under 1/1.2 of llama.cpp's.
This loads the engine and llama.cpp's Q4_K_M of the same model (made as `--peer llamacpp`
makes it) side by side and alternates, block by block: llama.cpp decoding `--steps` tokens,
the engine's forward decoding as many at one row, and only the engine's int8 GEMM calls
(every packed weight of a step, in order, on integer rows, no other op). It prints the
median ms per step of each and the load average. The GEMMs alone bound what fewer other ops
can win; what is left of the gap needs fewer weight bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time


def step_products(decoder) -> list:
    """(packed weight, integer row of its input width, row limit) for each int8 GEMM of a
    decode step, in the order a one-row forward calls them."""
    import torch

    gen = torch.Generator().manual_seed(0)
    return [
        (packed, _integer_row(lin.in_features, lin.limit, gen), lin.limit)
        for lin in decoder.step_linears()
        for packed in lin._packed
    ]


def _integer_row(width: int, limit: int, gen):
    import torch

    return torch.randn(1, width, generator=gen).mul_(40).round_().clamp_(-limit, limit)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.engine.gemm_floor", description=__doc__)
    parser.add_argument("--model", default="qwen-shape")
    parser.add_argument("--blocks", type=int, default=6)
    parser.add_argument("--steps", type=int, default=64)
    args = parser.parse_args(argv)
    if args.blocks < 1 or args.steps < 1:
        parser.error("--blocks and --steps must be 1 or more")

    import torch

    from bench.engine.step_jitter import engine_and_prompt
    from bench.models import resolve_model
    from bench.peer_llamacpp import LlamaCppSide, PeerMissing, ensure_ggufs
    from inference.model.decoder import Segment
    from inference.quant.rowint8 import integer_product
    from service.config import load_config

    engine, ids, threads = engine_and_prompt(args.model, None)
    decoder = engine.decoder
    if not decoder.step_linears():
        parser.error("the engine does not run fused per-row int8 here: nothing to compare")
    config = load_config([], os.environ)
    try:
        ggufs = ensure_ggufs(
            resolve_model(args.model, config.cache_dir, None), config.cache_dir, threads
        )
    except PeerMissing as exc:
        parser.error(str(exc))
    peer = LlamaCppSide(str(ggufs["llamacpp_q4_k_m"]), threads)
    products = step_products(decoder)
    times: dict[str, list[float]] = {
        "llama.cpp Q4_K_M step": [],
        "engine forward": [],
        "engine int8 GEMMs alone": [],
    }
    load_before = os.getloadavg()[0]
    with torch.inference_mode():
        for _ in range(args.blocks):
            _, ttft, total = peer.run(ids, args.steps + 1)
            times["llama.cpp Q4_K_M step"].append((total - ttft) / args.steps * 1000)
            cache = decoder.new_cache(len(ids) + args.steps)
            decoder.forward([Segment(cache, ids)])
            start = time.perf_counter()
            for i in range(args.steps):
                decoder.forward([Segment(cache, [ids[i % len(ids)]], decoding=True)])
            times["engine forward"].append((time.perf_counter() - start) / args.steps * 1000)
            start = time.perf_counter()
            for _ in range(args.steps):
                for packed, row, limit in products:
                    integer_product(row, packed, limit)
            times["engine int8 GEMMs alone"].append(
                (time.perf_counter() - start) / args.steps * 1000
            )
    report = {k: round(statistics.median(v), 2) for k, v in times.items()}
    report["gemm_calls_per_step"] = len(products)
    report["load_1m"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
