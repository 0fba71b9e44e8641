"""Forward CPU time of one model: torch.ao int8 (one activation scale per forward) against
per-row int8 (inference/quant/rowint8.py), both loaded in this process and run interleaved, one
thread, `time.thread_time` (robust to other processes on a shared machine).

    python -m bench.engine.int8_steps [MODEL_DIR]   (default: the Qwen shape in ~/.cache/deskchat)

Decode steps at B = 1, 2, 4, 8 rows over a 64-token context, and prefill of 64 and 256 tokens;
medians in ms, printed and written to int8_steps.json.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer, DynamicCache

from inference.loading.checkpoint import load_quantized
from inference.quant import smooth


def cpu_ms(f) -> float:
    start = time.thread_time()
    f()
    return (time.thread_time() - start) * 1000


def main() -> None:
    torch.set_num_threads(1)
    folder = Path(sys.argv[1] if len(sys.argv) > 1 else "~/.cache/deskchat/qwen-shape")
    folder = folder.expanduser()
    tok = AutoTokenizer.from_pretrained(folder)
    cal = tok(smooth.CALIBRATION_TEXT, return_tensors="pt")["input_ids"]
    models = {
        "per_row": load_quantized(folder, "int8-row", "auto", cal),
        "torch_ao": load_quantized(folder, "int8", "auto", cal),
    }
    gen = torch.Generator().manual_seed(0)
    vocab = models["per_row"].config.vocab_size
    results = {}
    with torch.inference_mode():
        for b in (1, 2, 4, 8):
            context = torch.randint(0, vocab, (b, 64), generator=gen)
            step = torch.randint(0, vocab, (b, 1), generator=gen)
            times = {}
            for name, m in models.items():
                cache = DynamicCache(config=m.config)
                m(input_ids=context, cache=cache, use_cache=True, logits_to_keep=1)
                times[name] = (m, cache, [])
            for _ in range(12):
                for m, cache, out in times.values():
                    out.append(cpu_ms(lambda m=m, c=cache, s=step: m(input_ids=s, cache=c)))
                    cache.crop(-1)
            results[f"decode B={b}"] = {k: statistics.median(v[2][2:]) for k, v in times.items()}
            print(f"decode B={b}", results[f"decode B={b}"], flush=True)
        for n in (64, 256):
            ids = torch.randint(0, vocab, (1, n), generator=gen)
            times = {name: [] for name in models}
            for _ in range(5):
                for name, m in models.items():
                    times[name].append(cpu_ms(lambda m=m, i=ids: m(input_ids=i, logits_to_keep=1)))
            results[f"prefill {n}"] = {k: statistics.median(v[1:]) for k, v in times.items()}
            print(f"prefill {n}", results[f"prefill {n}"], flush=True)
    Path("int8_steps.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
