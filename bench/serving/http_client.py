"""--http: measure a running deskchat server through POST /chat, streamed, N clients at once.

Each client sends the fixed prompts `rounds` times, one request after the other; TTFT is
the time to the first `delta` event, latency the time to the `done` event, and the gaps
between deltas are the inter-token times a reader of the stream sees. Standard library
only, so it runs from any machine on the LAN.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from urllib.parse import urlsplit

from bench.prompts import PROMPTS
from bench.stats import percentile


def chat_once(
    url: str, messages: list[dict], max_tokens: int, timeout: float = 600, **fields
) -> dict:
    """One streamed request; {ttft_ms, latency_s, tokens, arrivals, text, done} or {error}.
    `arrivals` are the perf_counter times of the deltas, `text` their text, `done` the final
    event (usage, timings); `fields` are more body fields (temperature, ...)."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=timeout)
    body = json.dumps({"messages": messages, "max_tokens": max_tokens, "stream": True, **fields})
    started = time.perf_counter()
    arrivals: list[float] = []
    pieces: list[str] = []
    try:
        conn.request(
            "POST",
            parts.path.rstrip("/") + "/chat",
            body=body,
            headers={"Content-Type": "application/json"},
        )
        response = conn.getresponse()
        if response.status != 200:
            return {"error": f"HTTP {response.status}: {response.read()[:200]!r}"}
        for raw in response:
            line = raw.decode("utf-8").strip()
            if line.startswith("event: error"):
                return {"error": "error event in the stream"}
            if not line.startswith("data: "):
                continue
            event = json.loads(line[6:])
            if "delta" in event:
                arrivals.append(time.perf_counter())
                pieces.append(event["delta"])
            if event.get("done"):
                end = time.perf_counter()
                return {
                    "ttft_ms": ((arrivals[0] if arrivals else end) - started) * 1000,
                    "latency_s": end - started,
                    "tokens": event["usage"]["completion_tokens"],
                    "arrivals": arrivals,
                    "text": "".join(pieces),
                    "done": event,
                }
        return {"error": "the stream ended without a done event"}
    except (OSError, ValueError, KeyError) as exc:  # network, or a malformed event
        return {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        conn.close()


def run_http(url: str, clients: int, rounds: int, max_tokens: int) -> dict:
    results: list[dict] = []
    lock = threading.Lock()

    def client() -> None:
        for _ in range(rounds):
            for messages in PROMPTS.values():
                outcome = chat_once(url, messages, max_tokens)
                with lock:
                    results.append(outcome)

    started = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - started
    ok = [r for r in results if "error" not in r]
    latency = [r["latency_s"] for r in ok]
    ttft = [r["ttft_ms"] for r in ok]
    gaps = [g for r in ok for g in gaps_ms(r["arrivals"])]
    return {
        "url": url,
        "clients": clients,
        "requests": len(results),
        "errors": len(results) - len(ok),
        "ttft_ms_p50": round(percentile(ttft, 50), 1),
        "ttft_ms_p90": round(percentile(ttft, 90), 1),
        "ttft_ms_p99": round(percentile(ttft, 99), 1),
        "gap_ms_p50": round(percentile(gaps, 50), 1),
        "gap_ms_p99": round(percentile(gaps, 99), 1),
        "latency_s_p50": round(percentile(latency, 50), 3),
        "latency_s_p99": round(percentile(latency, 99), 3),
        "total_tokens_per_s": round(sum(r["tokens"] for r in ok) / wall, 2),
        "wall_s": round(wall, 2),
    }


def gaps_ms(arrivals: list[float]) -> list[float]:
    return [(b - a) * 1000 for a, b in zip(arrivals, arrivals[1:], strict=False)]
