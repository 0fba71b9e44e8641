"""--batch-curve: the server with the batch off and at given sizes, 1..N clients each.

For each `--max-batch` value it starts `server.py` on the model (bench/launcher.py's Server:
a loopback port, its log in a temporary folder), waits until it is ready, runs `--http`
with 1, 2, 4, 8 clients one after the other, and then a long-prompt probe: while three
clients stream long answers, one request with a prompt of about 1,000 tokens arrives; the
probe reports the three streams' inter-token gaps during its prefill (its arrival to its
first token). One table, rows in the order measured, so the batch-off and batched figures
come from one run on one machine.
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.launcher import Server, Setting
from bench.models import resolve_model
from bench.prompts import PROMPTS
from bench.serving.http_client import chat_once, gaps_ms, run_http
from bench.stats import peak_rss_mb, percentile

LONG_PROMPT = [
    {
        "role": "user",
        "content": "Summarize these meeting notes in three bullet points.\n"
        + "Budget approved for the printers; the launch moved to May; two engineers hired. " * 60,
    }
]
STORY = [{"role": "user", "content": "Write a long story about an office printer."}]
PROBE_STREAMS = 3
PROBE_ANSWER_TOKENS = 400


def long_prompt_probe(url: str, prompt: list[dict] = LONG_PROMPT, quiet_s: float = 3.0) -> dict:
    """Inter-token gaps of PROBE_STREAMS running streams while `prompt` (by default about
    1,000 tokens) is prefilled beside them, and before it came (from each stream's second
    token on: the quiet gaps)."""
    runners: list[dict] = [{} for _ in range(PROBE_STREAMS)]

    def run(i):
        runners[i] = chat_once(url, STORY, PROBE_ANSWER_TOKENS)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(PROBE_STREAMS)]
    for thread in threads:
        thread.start()
    time.sleep(quiet_s)  # the streams are decoding
    sent = time.perf_counter()
    long = chat_once(url, prompt, 8)
    for thread in threads:
        thread.join()
    if "error" in long or any("error" in r for r in runners):
        errors = [r.get("error") for r in [long, *runners] if "error" in r]
        return {"error": "; ".join(errors)}
    first = long["arrivals"][0] if long["arrivals"] else sent
    during, quiet = [], []
    for r in runners:
        times = [t for t in r["arrivals"] if sent <= t <= first]
        before = [t for t in r["arrivals"] if t < sent]
        during += gaps_ms(before[-1:] + times)  # with the gap spanning `sent`
        quiet += gaps_ms(before)
    return {
        "long_ttft_ms": round(long["ttft_ms"], 1),
        "gap_ms_p50_quiet": round(percentile(quiet, 50), 1) if quiet else None,
        "gap_ms_p99_quiet": round(percentile(quiet, 99), 1) if quiet else None,
        "gaps_quiet": len(quiet),
        "gap_ms_p50_during": round(percentile(during, 50), 1),
        "gap_ms_p99_during": round(percentile(during, 99), 1),
        "gaps_during": len(during),
    }


def run_curve(
    model_dir: Path,
    cache_dir: Path,
    batches: list[int],
    clients: list[int],
    rounds: int,
    max_tokens: int,
) -> dict:
    rows, probes = [], []
    # A bench stopped with SIGTERM (timeout, kill) still stops the servers it started.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    logs = Path(tempfile.mkdtemp(prefix="deskchat-batch-curve-"))
    for max_batch in batches:
        flags = ("--max-batch", str(max_batch), "--max-queue", "32", "--request-timeout", "900")
        server = Server(model_dir, cache_dir, Setting(flags), logs)
        try:
            server.wait_ready(timeout=900)
            for n in clients:
                load = os.getloadavg()[0]
                row = run_http(server.url, n, rounds, max_tokens)
                row.update(max_batch=max_batch, loadavg_1m=round(load, 2))
                rows.append(row)
                print(format_row(row), flush=True)
            probe = long_prompt_probe(server.url)
            probe.update(max_batch=max_batch, peak_rss_mb=round(peak_rss_mb(server.proc.pid), 1))
            probes.append(probe)
            print(probe, flush=True)
        finally:
            server.stop()
    return {"rows": rows, "probes": probes}


HEADER = (
    "| max_batch | clients | total tok/s | TTFT p50 ms | TTFT p99 ms | gap p50 ms | gap p99 ms "
    "| errors | load 1m |\n|---|---|---|---|---|---|---|---|---|"
)


def format_row(row: dict) -> str:
    keys = ["total_tokens_per_s", "ttft_ms_p50", "ttft_ms_p99", "gap_ms_p50", "gap_ms_p99"]
    cells = [str(row["max_batch"]), str(row["clients"]), *(str(row[k]) for k in keys)]
    return "| " + " | ".join([*cells, str(row["errors"]), str(row["loadavg_1m"])]) + " |"


def format_table(report: dict) -> str:
    lines = [HEADER, *(format_row(r) for r in report["rows"])]
    lines.append("")
    lines.append(
        "| max_batch | long prompt TTFT ms | streams' gap p50 / p99 ms during its prefill "
        "| peak RSS MB |"
    )
    lines.append("|---|---|---|---|")
    for p in report["probes"]:
        if "error" in p:
            lines.append(f"| {p['max_batch']} | error: {p['error']} | | |")
            continue
        gaps = f"{p['gap_ms_p50_during']} / {p['gap_ms_p99_during']} ({p['gaps_during']} gaps)"
        lines.append(f"| {p['max_batch']} | {p['long_ttft_ms']} | {gaps} | {p['peak_rss_mb']} |")
    return "\n".join(lines)


def run(args, config) -> dict:
    """`python -m bench --batch-curve`: the curve on --model, its tables printed."""
    model_dir = resolve_model(args.model, config.cache_dir, args.fixture)
    batches = [int(b) for b in args.batches.split(",")]
    clients = [int(c) for c in args.client_counts.split(",")]
    print(
        f"model {model_dir}; {args.rounds} rounds x {len(PROMPTS)} prompts x "
        f"{args.max_tokens} tokens per client; load {os.getloadavg()[0]:.2f}"
    )
    report = run_curve(model_dir, config.cache_dir, batches, clients, args.rounds, args.max_tokens)
    print(format_table(report))
    return report
