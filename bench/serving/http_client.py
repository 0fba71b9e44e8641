"""--http: measure a running deskchat server through POST /chat, streamed, N clients at once;
and the streamed clients of both dialects the other HTTP benches send with.

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
from collections.abc import Callable
from urllib.parse import urlsplit

from bench.prompts import PROMPTS
from bench.stats import percentile


class StreamRefused(Exception):
    """The server answered a streamed POST with another status than 200."""


def stream_lines(url: str, path: str, body: dict, timeout: float):
    """The lines of a streamed POST's answer (server-sent events), stripped."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=timeout)
    try:
        conn.request(
            "POST",
            parts.path.rstrip("/") + path,
            body=json.dumps(body),
            headers={"Content-Type": "application/json"},
        )
        response = conn.getresponse()
        if response.status != 200:
            raise StreamRefused(f"HTTP {response.status}: {response.read()[:200]!r}")
        for raw in response:
            yield raw.decode("utf-8").strip()
    finally:
        conn.close()


def _error_text(exc: Exception) -> str:
    return str(exc) if isinstance(exc, StreamRefused) else f"{type(exc).__name__}: {exc}"


def chat_once(
    url: str,
    messages: list[dict],
    max_tokens: int,
    timeout: float = 600,
    on_first: Callable[[], None] | None = None,
    **fields,
) -> dict:
    """One streamed request; {ttft_ms, latency_s, tokens, arrivals, text, done} or {error}.
    `arrivals` are the perf_counter times of the deltas, `text` their text, `done` the final
    event (usage, timings); `on_first` is called once the first delta's time is taken;
    `fields` are more body fields (temperature, ...)."""
    body = {"messages": messages, "max_tokens": max_tokens, "stream": True, **fields}
    started = time.perf_counter()
    arrivals: list[float] = []
    pieces: list[str] = []
    try:
        for line in stream_lines(url, "/chat", body, timeout):
            if line.startswith("event: error"):
                return {"error": "error event in the stream"}
            if not line.startswith("data: "):
                continue
            event = json.loads(line[6:])
            if "delta" in event:
                arrivals.append(time.perf_counter())
                pieces.append(event["delta"])
                if on_first is not None and len(arrivals) == 1:
                    on_first()
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
    except (OSError, ValueError, KeyError, StreamRefused) as exc:  # network, or a bad event
        return {"error": _error_text(exc)}


def openai_once(url: str, body: dict, timeout: float = 600) -> dict:
    """One streamed POST /v1/chat/completions as any OpenAI client sends it (deskchat and
    llama-server alike); {ttft_ms, latency_s, tokens, prompt_tokens, arrivals, text,
    finish_reason, timings} or {error}. `arrivals`: the times of the chunks that carry text
    or a tool call's piece (the first chunk's empty role-only delta is no token); `text` the
    content; the token counts are the server's usage; `timings` the server's own (each
    server its own keys: deskchat's `ttft_ms`, llama-server's `prompt_n`, `cache_n`, ...)."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    arrivals: list[float] = []
    pieces: list[str] = []
    finish = usage = timings = None
    try:
        for line in stream_lines(url, "/v1/chat/completions", body, timeout):
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return {"error": f"error in the stream: {chunk['error']}"}
            for choice in chunk.get("choices") or ():
                delta = choice.get("delta") or {}
                if delta.get("content") or delta.get("tool_calls"):
                    arrivals.append(time.perf_counter())
                    pieces.append(delta.get("content") or "")
                finish = choice.get("finish_reason") or finish
            usage = chunk.get("usage") or usage
            timings = chunk.get("timings") or timings
    except (OSError, ValueError, StreamRefused) as exc:
        return {"error": _error_text(exc)}
    end = time.perf_counter()
    if not usage or not arrivals:
        return {"error": f"no {'usage' if arrivals else 'text'} in the stream"}
    return {
        "ttft_ms": (arrivals[0] - started) * 1000,
        "latency_s": end - started,
        "tokens": usage["completion_tokens"],
        "prompt_tokens": usage["prompt_tokens"],
        "arrivals": arrivals,
        "text": "".join(pieces),
        "finish_reason": finish,
        "timings": timings or {},
    }


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
