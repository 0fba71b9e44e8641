"""`python -m bench.quality`: how far each side's next-token distribution is from fp32's.

llama.cpp's measure (llama-perplexity --kl-divergence): over a fixed text set (English,
Chinese and Python code, `bench/quality_texts/`, written for this repository), split into
chunks of CHUNK tokens each run from an empty context, the mean KL divergence of a side's
next-token distribution from fp32's at every position, and how often both rank the same
token first (top-1 agreement). Every side sees the same token ids (our tokenizer's).

Sides: the engine at each `--quantize` setting (through the forward it serves with,
inference/model/decoder.py, loaded as the server loads it), and with `--peer llamacpp` llama.cpp's
Q8_0 and Q4_K_M of the same weights (the optional extra, bench/peer_llamacpp.py; converted
from an f32 GGUF so that no bf16 rounding is charged to them).
tests/inference/quant/test_quality.py holds the default setting to llama.cpp Q4_K_M's
figures from this bench.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from pathlib import Path

import torch

TEXTS = Path(__file__).resolve().parent / "quality_texts"
TEXT_NAMES = ("english", "chinese", "code")
CHUNK = 256


def text_chunks(tokenizer, chunk: int = CHUNK) -> list[list[int]]:
    """The text set's token ids in chunks of `chunk` (a text's last, shorter chunk kept when
    it has at least 2 tokens, so that it predicts something)."""
    chunks = []
    for name in TEXT_NAMES:
        ids = tokenizer((TEXTS / f"{name}.txt").read_text(encoding="utf-8"))["input_ids"]
        chunks += [ids[s : s + chunk] for s in range(0, len(ids), chunk) if len(ids) - s >= 2]
    return chunks


@torch.inference_mode()
def fp32_logprobs(model, chunks: list[list[int]]) -> list[torch.Tensor]:
    """transformers' own fp32 forward: [len(chunk), vocab] log-probabilities per chunk."""
    return [
        model(input_ids=torch.tensor([ids])).logits[0].float().log_softmax(-1) for ids in chunks
    ]


def decoder_logprobs(decoder, chunks: list[list[int]]):
    """The served forward (inference/model/decoder.py), every position of each chunk, one chunk
    at a time (a generator: only fp32's side is held whole)."""
    from inference.model.decoder import Segment

    for ids in chunks:
        with torch.inference_mode():
            cache = decoder.new_cache(len(ids))
            logits = decoder.forward([Segment(cache, ids)], every_row=True)
            yield logits.log_softmax(-1)


def distance(want: list[torch.Tensor], got) -> dict:
    """Mean KL(want || got) and top-1 agreement over every position but each chunk's last
    (whose prediction has no token to compare against in the text), plus the count."""
    kl, agree, count = 0.0, 0, 0
    for w, g in zip(want, got, strict=True):
        w, g = w[:-1], g[:-1, : w.shape[-1]]
        kl += float((w.exp() * (w - g)).sum())
        agree += int((w.argmax(-1) == g.argmax(-1)).sum())
        count += w.shape[0]
    return {"mean_kl": kl / count, "top1": agree / count, "positions": count}


def llamacpp_logprobs(gguf: Path, chunks: list[list[int]], threads: int):
    """llama.cpp's logits for every position (logits_all), through llama-cpp-python, one
    chunk at a time."""
    from bench.peer_llamacpp import require_llama_cpp

    llama_cpp = require_llama_cpp()
    llm = llama_cpp.Llama(
        model_path=str(gguf),
        n_ctx=max(len(c) for c in chunks),
        n_batch=CHUNK,
        n_threads=threads,
        n_threads_batch=threads,
        logits_all=True,
        verbose=False,
    )
    try:
        for ids in chunks:
            llm.reset()
            llm.eval(ids)
            logits = torch.from_numpy(llm.scores[: len(ids)].copy())
            yield logits.float().log_softmax(-1)
    finally:
        llm.close()


def engine_decoder(folder: Path, quantize: str, threads: int):
    """The engine's Decoder as the server would load it with DESKCHAT_QUANTIZE=quantize."""
    from inference.loading.assemble import ModelChoice, load_model
    from service.config import load_config

    config = dataclasses.replace(load_config([], os.environ), quantize=quantize, threads=threads)
    engine, _prompts = load_model(ModelChoice(folder, folder.name), config, lambda _m: None)
    return engine.decoder


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.quality", description=__doc__)
    parser.add_argument("--model", default="embedded", help="[default: embedded, real weights]")
    parser.add_argument(
        "--quantize",
        default="auto,int8,int4",
        help="engine settings to measure, comma-separated [default: auto,int8,int4]",
    )
    parser.add_argument("--peer", choices=["llamacpp"], default=None)
    parser.add_argument("--threads", type=int, default=None, help="[default: the server's]")
    parser.add_argument("--json", type=Path, default=None, help="write the results here too")
    args = parser.parse_args(argv)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from bench.models import resolve_model
    from service.config import load_config

    config = load_config([], os.environ)
    threads = args.threads or config.threads
    torch.set_num_threads(threads)
    folder = Path(resolve_model(args.model, config.cache_dir, None))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    chunks = text_chunks(tokenizer)
    print(f"{folder.name}: {sum(map(len, chunks))} tokens in {len(chunks)} chunks of <= {CHUNK}")
    fp32 = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    want = fp32_logprobs(fp32, chunks)
    del fp32

    sides = {}
    for quantize in [q.strip() for q in args.quantize.split(",") if q.strip()]:
        started = time.perf_counter()
        decoder = engine_decoder(folder, quantize, threads)
        sides[f"engine {quantize}"] = distance(want, decoder_logprobs(decoder, chunks))
        del decoder
        print(
            f"  engine {quantize}: {sides[f'engine {quantize}']}",
            f"{time.perf_counter() - started:.0f} s",
        )
    if args.peer == "llamacpp":
        from bench.peer_llamacpp import ensure_ggufs

        for side, gguf in ensure_ggufs(folder, config.cache_dir, threads, outtype="f32").items():
            sides[side] = distance(want, llamacpp_logprobs(gguf, chunks, threads))
            print(f"  {side}: {sides[side]}")

    print("\n| side | mean KL to fp32 | top-1 agreement |\n|---|---|---|")
    for side, d in sides.items():
        print(f"| {side} | {d['mean_kl']:.4f} | {100 * d['top1']:.1f}% |")
    if args.json:
        meta = {"model": folder.name, "chunk": CHUNK, "threads": threads}
        args.json.write_text(json.dumps({"sides": sides, "meta": meta}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
