"""--http: measure a running deskchat server through POST /chat, streamed, N clients at once."""

from __future__ import annotations


def run_http(url: str, clients: int, rounds: int, max_tokens: int) -> dict:
    raise SystemExit("--http is not implemented yet")
