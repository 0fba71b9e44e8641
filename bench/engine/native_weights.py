"""Decode speed of the native step with int8-row against int4-row weights (issue 36: bytes
per token), both loaded in this process and stepped alternately, so that a shared machine's
noise falls on both alike.

    python -m bench.engine.native_weights [--model qwen-shape] [--steps 48] [--threads 2]

One stream decoding after a 64-token prompt, wall time per step (the step runs on the
native pool's threads); medians in tok/s, the weights' resident bytes of each, and the load
average before and after, printed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

KINDS = ("int8-row", "int4-row")


def weight_bytes(decoder) -> int:
    """Bytes of the tensors the native step reads for the Linears (lm_head included)."""
    return sum(
        t.numel() * t.element_size()
        for name, t in decoder.model.state_dict().items()
        if "proj" in name or "lm_head" in name
    )


def main(argv: list[str] | None = None) -> None:
    from transformers import AutoTokenizer

    from bench.models import resolve_model
    from inference.loading.checkpoint import load_quantized
    from inference.model.decoder import Decoder, Segment
    from inference.native import build
    from inference.native.library import load
    from inference.quant.smooth import CALIBRATION_TEXT
    from service.config import load_config

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen-shape")
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    folder = resolve_model(args.model, load_config([], os.environ).cache_dir, None)
    library = load(tuple(build.runnable_here()))  # this CPU's own build, as the server's
    calibration = AutoTokenizer.from_pretrained(folder)(CALIBRATION_TEXT, return_tensors="pt")
    decoders = {
        kind: Decoder(
            load_quantized(folder, kind, "auto", calibration["input_ids"], library), 1024, library
        )
        for kind in KINDS
    }
    print(f"load average before: {os.getloadavg()}")
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 1000, (64,), generator=gen).tolist()
    caches = {kind: d.new_cache(1024) for kind, d in decoders.items()}
    seconds: dict[str, list[float]] = {kind: [] for kind in KINDS}
    with torch.inference_mode():
        for kind, d in decoders.items():
            d.forward([Segment(caches[kind], prompt)])
        for step in range(args.steps):
            for kind, d in decoders.items():
                start = time.perf_counter()
                d.forward([Segment(caches[kind], [step % 1000 + 1], decoding=True)])
                seconds[kind].append(time.perf_counter() - start)
    for kind, d in decoders.items():
        rate = 1 / statistics.median(seconds[kind][2:])
        print(
            f"{kind}: decode {rate:.2f} tok/s (median of {args.steps - 2}), "
            f"Linear weights {weight_bytes(d) / 1e6:.1f} MB, native {library.isa} build"
        )
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
