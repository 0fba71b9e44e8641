"""The server's own peak memory with a full batch of long contexts (its bound: docs/batching.md).

Starts `server.py` on the model at --max-batch N, reads its VmHWM once it is ready, then
sends N streamed requests at once, each a prompt of about --context tokens less the answer's
--max-tokens, and reads VmHWM again after they are done. VmHWM is the process's own
high-water mark (/proc/PID/status), not ru_maxrss, which keeps a parent's across exec.

    python -m bench.serving.memory --model qwen-shape --max-batch 4 --context 1000
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
from pathlib import Path

from bench.launcher import Server, Setting
from bench.models import resolve_model
from bench.serving.http_client import chat_once
from bench.stats import peak_rss_mb
from service.config import load_config

SENTENCE = "Budget approved for the printers; the launch moved to May; two engineers hired. "


def long_prompt(tokens: int, i: int) -> list[dict]:
    """About `tokens` tokens (a sentence is ~17 on Qwen's and SmolLM2's tokenizers), each
    request's text its own so no prefix is shared."""
    return [
        {
            "role": "user",
            "content": f"Note {i}. Summarize these notes.\n" + SENTENCE * max(1, tokens // 17),
        }
    ]


def rss_mb(pid: int) -> float:
    """The process's resident set now (VmRSS), beside its peak: what a load's peak left."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def measure(
    model: str, max_batch: int, context: int, answer: int, flags: list[str], ready_s: float
) -> dict:
    config = load_config([], os.environ)
    folder = Path(resolve_model(model, config.cache_dir, None))
    with tempfile.TemporaryDirectory() as logs:
        chosen = Setting(("--max-batch", str(max_batch), *flags))
        server = Server(folder, config.cache_dir, chosen, Path(logs))
        try:
            server.wait_ready(ready_s)
            ready, ready_rss = peak_rss_mb(server.proc.pid), rss_mb(server.proc.pid)
            results: list[dict] = [{} for _ in range(max_batch)]

            def run(i: int) -> None:
                prompt = long_prompt(context - answer, i)
                results[i] = chat_once(server.url, prompt, answer)

            threads = [threading.Thread(target=run, args=(i,)) for i in range(max_batch)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            errors = [r["error"] for r in results if "error" in r]
            usage = [r.get("done", {}).get("usage", {}) for r in results]
            return {
                "model": folder.name,
                "max_batch": max_batch,
                "flags": flags,
                "vmhwm_ready_mb": round(ready, 1),
                "vmhwm_after_mb": round(peak_rss_mb(server.proc.pid), 1),
                "vmrss_ready_mb": round(ready_rss, 1),
                "vmrss_after_mb": round(rss_mb(server.proc.pid), 1),
                "contexts": [
                    u.get("prompt_tokens", 0) + u.get("completion_tokens", 0) for u in usage
                ],
                "errors": errors,
            }
        finally:
            server.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.serving.memory", description=__doc__)
    parser.add_argument("--model", default="qwen-shape")
    parser.add_argument("--max-batch", type=int, default=4)
    parser.add_argument("--context", type=int, default=1000, help="tokens per stream, in all")
    parser.add_argument("--max-tokens", type=int, default=100, help="answer tokens per stream")
    parser.add_argument(
        "--ready-timeout", type=float, default=3600, help="seconds (a 3B shape's first load)"
    )
    parser.add_argument("flags", nargs="*", help="more server flags (after --)")
    args = parser.parse_args(argv)
    report = measure(
        args.model, args.max_batch, args.context, args.max_tokens, args.flags, args.ready_timeout
    )
    print(json.dumps(report, indent=2))
    return 1 if report["errors"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
