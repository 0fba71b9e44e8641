"""--long-prompt: what a long prompt costs the streams answering beside it, by its length;
the `--max-prompt-tokens` default rests on it.

One `server.py` at its defaults, but for `--max-prompt-tokens` and `--context-tokens` wide
enough for the longest length asked. For each length: three clients stream long answers;
after `--quiet-s` seconds of their decoding one request arrives whose prompt has that many
tokens (counted by the server's /tokenize; a number of its own first, so the prefix cache
holds none of it). Reported per length: the long prompt's TTFT and the three streams' token
gaps, p50 / p99, before it came (quiet) and while it was prefilled, and their ratio.

    python -m bench --long-prompt --model qwen-shape --cache-dir DIR --lengths 1000,2000,3500
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import urllib.request
from pathlib import Path

from bench.launcher import Server, Setting
from bench.models import MODEL_HELP, resolve_model
from bench.serving.batching import long_prompt_probe
from bench.serving.versus import READY_TIMEOUT_S

SENTENCE = "Budget approved for the printers; the launch moved to May; two engineers hired. "
ASK = "Summarize these meeting notes in three bullet points.\n"


def count(url: str, messages: list[dict]) -> int:
    """The prompt tokens of `messages` with the chat template, as the server counts them."""
    body = json.dumps({"messages": messages}).encode()
    request = urllib.request.Request(url + "/tokenize", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as reply:
        return json.load(reply)["count"]


def prompt_of(url: str, tokens: int, nonce: int) -> tuple[list[dict], int]:
    """A user message of about `tokens` prompt tokens (at most that many), and its count."""

    def message(n: int) -> list[dict]:
        return [{"role": "user", "content": f"Meeting {nonce}. {ASK}{SENTENCE * n}"}]

    one = count(url, message(1))
    per = count(url, message(2)) - one
    n = max(1, (tokens - one) // per + 1)
    counted = count(url, message(n))
    while n > 1 and counted > tokens:
        n -= 1
        counted = count(url, message(n))
    return message(n), counted


def run(model_dir: Path, cache_dir: Path, lengths: list[int], quiet_s: float) -> dict:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stops the server it started
    longest = max(lengths)
    flags = ["--max-prompt-tokens", str(longest), "--request-timeout", "900"]
    flags += ["--context-tokens", str(max(4096, longest + 512))]
    logs = Path(tempfile.mkdtemp(prefix="deskchat-long-prompt-"))
    server = Server(model_dir, cache_dir, Setting(tuple(flags)), logs)
    rows = []
    try:
        server.wait_ready(timeout=READY_TIMEOUT_S)
        for i, wanted in enumerate(lengths):
            prompt, tokens = prompt_of(server.url, wanted, i)
            load = os.getloadavg()[0]
            row = {"prompt_tokens": tokens, "loadavg_1m": round(load, 2)}
            row.update(long_prompt_probe(server.url, prompt, quiet_s))
            if "error" not in row:
                row["p50_ratio"] = round(row["gap_ms_p50_during"] / row["gap_ms_p50_quiet"], 2)
                row["p99_ratio"] = round(row["gap_ms_p99_during"] / row["gap_ms_p99_quiet"], 2)
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        server.stop()
    return {"model": model_dir.name, "rows": rows, "loadavg_1m_after": os.getloadavg()[0]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench --long-prompt", description=__doc__)
    parser.add_argument("--model", default="qwen-shape", help=MODEL_HELP)
    parser.add_argument("--cache-dir", type=Path, default=None)
    parser.add_argument("--fixture", default=None)
    parser.add_argument("--lengths", default="1000,2000,3500")
    parser.add_argument("--quiet-s", type=float, default=5.0)
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args(argv)
    from service.config import load_config

    env = dict(os.environ)
    if args.cache_dir:
        env["DESKCHAT_CACHE_DIR"] = str(args.cache_dir)
    config = load_config([], env)
    model_dir = resolve_model(args.model, config.cache_dir, args.fixture)
    print(f"model {model_dir}; load {os.getloadavg()[0]:.2f}", flush=True)
    lengths = [int(n) for n in args.lengths.split(",")]
    report = run(model_dir, config.cache_dir, lengths, args.quiet_s)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0
