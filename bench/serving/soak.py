"""Soak: mixed traffic against a running server for a given time, watching its memory.

    python -m bench.serving.soak --url http://127.0.0.1:8080 --pid PID --minutes 60 \
        [--clients 4] [--key KEY]

Each of `--clients` threads sends, one after the other with a pause between, a rotating mix
(each client starts at another place in it, so the batch holds different kinds at once):
plain and streamed answers on both dialects, a JSON-schema answer, a stream abandoned after
a few tokens, and bad requests (400). Samples the server's RSS (/proc/PID/status) every
`--sample-s` seconds and prints, at the end, RSS after the warm-up, at the end, the
least-squares slope in % per hour over the samples after warm-up, and the counts of
statuses seen. Not part of the test suite: it takes as long as it is told to.
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import threading
import time
from collections import Counter
from urllib.parse import urlsplit

from bench.grammar.cost import SCHEMA
from bench.prompts import PROMPTS

ASK = PROMPTS["short"]
OPENAI = "/v1/chat/completions"
MIX = [
    ("/chat", {"messages": ASK, "max_tokens": 32}, "plain"),
    ("/chat", {"messages": PROMPTS["multi_turn"], "max_tokens": 48, "stream": True}, "stream"),
    (OPENAI, {"messages": ASK, "max_tokens": 32}, "plain"),
    (OPENAI, {"messages": PROMPTS["chinese_code"], "max_tokens": 48, "stream": True}, "stream"),
    (OPENAI, {"messages": ASK, "max_tokens": 200, "stream": True}, "abandon"),
    (
        OPENAI,
        {
            "messages": [{"role": "user", "content": "Printer offline. Write the ticket."}],
            "max_tokens": 120,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "ticket", "schema": SCHEMA},
            },
        },
        "plain",
    ),
    ("/chat", {"message": "", "max_tokens": 4}, "plain"),  # a 400
    (OPENAI, {"messages": ASK, "n": 3}, "plain"),  # a 400
]


def rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


def send(url: str, path: str, body: dict, how: str, headers: dict) -> int:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=300)
    try:
        conn.request(
            "POST", path, json.dumps(body), {"Content-Type": "application/json", **headers}
        )
        response = conn.getresponse()
        if how == "abandon":
            response.fp.readline()  # the first event's line, then hang up
            return 499
        response.read()
        return response.status
    finally:
        conn.close()


def slope_pct_per_hour(samples: list[tuple[float, int]]) -> float:
    """Least-squares slope of RSS over time, in % of the first value per hour."""
    n = len(samples)
    mean_t = sum(t for t, _ in samples) / n
    mean_r = sum(r for _, r in samples) / n
    cov = sum((t - mean_t) * (r - mean_r) for t, r in samples)
    var = sum((t - mean_t) ** 2 for t, _ in samples) or 1.0
    return cov / var * 3600 / samples[0][1] * 100


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.serving.soak")
    parser.add_argument("--url", required=True)
    parser.add_argument("--pid", type=int, required=True, help="the server's process id")
    parser.add_argument("--minutes", type=float, default=60)
    parser.add_argument("--warmup-minutes", type=float, default=1)
    parser.add_argument("--pause-s", type=float, default=0.5, help="between requests")
    parser.add_argument("--sample-s", type=float, default=30)
    parser.add_argument("--clients", type=int, default=4, help="requests in flight at once")
    parser.add_argument("--key", default=None, help="API key, if the server needs one")
    args = parser.parse_args(argv)

    headers = {"Authorization": f"Bearer {args.key}"} if args.key else {}
    started = time.monotonic()
    end = started + args.minutes * 60
    statuses: Counter[int | str] = Counter()
    lock = threading.Lock()

    def client(offset: int) -> None:
        mix = itertools.islice(itertools.cycle(MIX), offset, None)
        for path, body, how in mix:
            if time.monotonic() >= end:
                return
            try:
                status: int | str = send(args.url, path, body, how, headers)
            except OSError as exc:
                status = type(exc).__name__
            with lock:
                statuses[status] += 1
            time.sleep(args.pause_s)

    clients = [
        threading.Thread(target=client, args=(i * len(MIX) // args.clients,), daemon=True)
        for i in range(args.clients)
    ]
    for thread in clients:
        thread.start()
    samples: list[tuple[float, int]] = []
    next_sample = started + args.warmup_minutes * 60
    while (now := time.monotonic()) < end:
        if now >= next_sample:
            samples.append((now - started, rss_kb(args.pid)))
            print(f"t={now - started:7.0f}s rss={samples[-1][1] / 1024:.1f} MB", flush=True)
            next_sample += args.sample_s
        time.sleep(min(1.0, max(0.0, end - now)))
    for thread in clients:
        thread.join()
    samples.append((time.monotonic() - started, rss_kb(args.pid)))
    report = {
        "minutes": args.minutes,
        "clients": args.clients,
        "rss_mb_after_warmup": round(samples[0][1] / 1024, 1),
        "rss_mb_at_end": round(samples[-1][1] / 1024, 1),
        "slope_pct_per_hour": round(slope_pct_per_hour(samples), 2) if len(samples) > 2 else None,
        "samples": len(samples),
        "statuses": {str(k): v for k, v in sorted(statuses.items(), key=str)},
    }
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
