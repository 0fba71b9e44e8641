"""The native step's builds side by side in one process: which level is fastest on this CPU.

    python -m bench.engine.native_levels [--model qwen-shape|embedded|DIR] [--levels avx2,avx-vnni]
        [--quantize int8-row|int4-row] [--prompt 512] [--decode 32] [--rounds 5] [--threads 2]

Why: a build level (inference/native/build.py) differs from another only in its kernels, so
the model is loaded once and each level's library gets its own NativeModel over the same
weights. Each round runs every level in turn (the order reversed every other round, so
a drift of the machine's load hits all alike): a `--prompt`-token prefill in one call, then
`--decode` one-row steps, then `--decode` steps of 4 streams at once. It prints one JSON
line per level with the medians (prompt tokens/s, decode tokens/s, 4-stream tokens/s) and
each round's figures, then the 1-minute load average before and after. Every level must
give the same logits (the tests' claim): a level that does not is reported. A level may also
be a built library's path (`python -m inference.native.build --isa avx2 --dir DIR` in another
checkout): a kernel change measured against the build before it, in one process.

Each rate is given twice: by the wall clock, and by the calling thread's CPU time
(`time.thread_time`, the `cpu_` ones). At `--threads 1` the step runs on the calling thread
alone, so the CPU-time rates are its cost whatever else the machine runs; on a shared
machine they are the ones to compare (the wall clock counts the time other processes took).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

STREAMS = 4


class Clocks:
    """Wall and this thread's CPU seconds since it was made."""

    def __init__(self):
        self.wall, self.cpu = time.perf_counter(), time.thread_time()

    def rates(self, name: str, tokens: int) -> dict:
        wall, cpu = time.perf_counter() - self.wall, time.thread_time() - self.cpu
        return {name: tokens / wall, f"cpu_{name}": tokens / cpu}


def run_level(decoder, prompt: list[int], decode: int) -> tuple[dict, object]:
    """One round on the decoder's current library: (tokens/s of each part, the logits)."""
    import torch

    from inference.model.decoder import Segment

    cache = decoder.new_cache(len(prompt) + decode)
    clocks = Clocks()
    outs = [decoder.forward([Segment(cache, prompt)])]
    rates = clocks.rates("prefill_tok_s", len(prompt))
    clocks = Clocks()
    for _ in range(decode):
        token = int(outs[-1][-1].argmax())
        outs.append(decoder.forward([Segment(cache, [token], decoding=True)]))
    rates |= clocks.rates("decode_tok_s", decode)
    caches = [decoder.new_cache(16 + decode) for _ in range(STREAMS)]
    for i, c in enumerate(caches):
        outs.append(decoder.forward([Segment(c, prompt[i : i + 16])]))
    clocks = Clocks()
    for step in range(decode):
        segments = [Segment(c, [prompt[step + i]], decoding=True) for i, c in enumerate(caches)]
        outs.append(decoder.forward(segments))
    rates |= clocks.rates("streams4_tok_s", STREAMS * decode)
    return rates, torch.cat(outs)


def main(argv: list[str] | None = None) -> int:
    prog = "python -m bench.engine.native_levels"
    parser = argparse.ArgumentParser(prog=prog, description=__doc__)
    parser.add_argument("--model", default="qwen-shape")
    parser.add_argument(
        "--levels", default=None, help="default: every level this CPU runs; or libraries' paths"
    )
    parser.add_argument("--quantize", default="int8-row", choices=("int8-row", "int4-row"))
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--decode", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)

    import torch
    from transformers import AutoTokenizer

    from bench.models import resolve_model
    from inference.loading.checkpoint import load_quantized
    from inference.model.decoder import Decoder
    from inference.native import build
    from inference.native.library import Library, NativeModel
    from inference.quant.smooth import CALIBRATION_TEXT
    from service.config import load_config

    levels = args.levels.split(",") if args.levels else build.runnable_here()
    libraries = {
        lvl: Library(Path(lvl) if lvl.endswith(".so") else build.build(lvl)) for lvl in levels
    }
    folder = resolve_model(args.model, load_config([], dict(os.environ)).cache_dir, None)
    calibration = AutoTokenizer.from_pretrained(folder)(CALIBRATION_TEXT, return_tensors="pt")
    first = libraries[levels[0]]
    model = load_quantized(folder, args.quantize, "auto", calibration["input_ids"], native=first)
    decoder = Decoder(model, args.prompt + args.decode + 16, first)
    steps = {lvl: NativeModel(lib, decoder) for lvl, lib in libraries.items()}
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, 20000, (args.prompt,), generator=gen).tolist()
    load_before = os.getloadavg()[0]
    rounds: dict[str, list[dict]] = {lvl: [] for lvl in levels}
    reference, differ = None, set()
    for r in range(args.rounds + 1):  # round 0 warms each level up, and is not counted
        for lvl in levels if r % 2 else levels[::-1]:
            decoder._native = steps[lvl]
            rates, logits = run_level(decoder, prompt, args.decode)
            reference = logits if reference is None else reference
            if not torch.equal(logits, reference):
                differ.add(lvl)
            if r:
                rounds[lvl].append(rates)
    for lvl in levels:
        row = {"level": lvl, "same_logits": lvl not in differ}
        for key in rounds[lvl][0]:
            row[key] = round(statistics.median(x[key] for x in rounds[lvl]), 1)
        row["rounds"] = [{k: round(v, 1) for k, v in x.items()} for x in rounds[lvl]]
        print(json.dumps(row), flush=True)
    tail = {"model": folder.name, "quantize": args.quantize, "threads": args.threads}
    tail["prompt"] = args.prompt
    tail |= {"loadavg_1m_before": load_before, "loadavg_1m_after": os.getloadavg()[0]}
    print(json.dumps(tail))
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
