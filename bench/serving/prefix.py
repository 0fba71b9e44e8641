"""--prefix: what the shared prefix cache saves, measured through HTTP as a user sees it.

Three workloads, each on a server with the cache on (the default) and one with it off
(`--no-prefix-cache`), started one after the other on the same model: (a) one tool sending
the same long system prompt and tool list with 20 different questions; (b) one 12-exchange
conversation, each request carrying the whole history; (c) fresh prompts that share
nothing. Reported: each request's time to first token, and for (c) tokens per second too,
so the ratios the cache must meet come from one run on one machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import urllib.request
from pathlib import Path

from bench.launcher import Server, Setting
from bench.models import resolve_model
from bench.serving.http_client import chat_once

TOOL_RULES = (
    "You are the help desk assistant of a small office. Answer staff questions about the "
    "printers, the shared drives, holiday requests, the VPN, meeting rooms and expenses. "
    "Keep answers short, name the form or the person to ask, and never invent policy. "
)
QUESTIONS = [
    f"Question {i}: how do I {task}?"
    for i, task in enumerate(
        [
            "book the large meeting room",
            "reset my VPN password",
            "claim a train ticket",
            "add a printer on a new laptop",
            "request three days off",
            "find last year's budget",
            "share a folder with a contractor",
            "report a broken monitor",
            "order a headset",
            "change my desk",
            "get a parking permit",
            "submit an invoice",
            "recover a file",
            "join the staff chat",
            "set an out-of-office reply",
            "print on both sides",
            "connect to the guest wifi",
            "ask for a second screen",
            "renew my badge",
            "cancel a room booking",
        ]
    )
]
CHAT = [
    "Let's plan the office move. What should we do first?",
    "Who should we tell, and when?",
    "What about the printers?",
    "And the network?",
    "How do we pack the kitchen?",
    "What can we throw away?",
    "How long will the move take?",
    "What could go wrong?",
    "How do we keep working during it?",
    "What do we do on the first day after?",
    "Who checks that everything works?",
    "Summarize the plan in five lines.",
]
FRESH = [
    "Write a haiku about Monday mornings.",
    "List three uses for a paperclip.",
    "Explain what a spreadsheet is to a child.",
    "Give two tips for a tidy desk.",
    "What is a good name for a team of accountants?",
    "Describe the colour blue without naming it.",
]
TOOLS = [  # in /chat's shape
    {
        "name": name,
        "description": f"{about} Use it only when the staff member asks for it.",
        "parameters": {
            "type": "object",
            "properties": {
                "who": {"type": "string", "description": "the staff member's name"},
                "when": {"type": "string", "description": "a date, as YYYY-MM-DD"},
                "details": {"type": "string", "description": "anything else needed"},
            },
            "required": ["who"],
        },
    }
    for name, about in [
        ("book_room", "Books a meeting room for a time slot."),
        ("open_ticket", "Opens a help desk ticket for broken equipment."),
        ("request_leave", "Files a holiday request with the manager."),
        ("reset_password", "Starts a password reset for the VPN or email."),
        ("order_item", "Orders office equipment from the approved catalogue."),
    ]
]


def one_tool(url: str, max_tokens: int) -> dict:
    system = {"role": "system", "content": TOOL_RULES * 8}
    runs = [
        chat_once(url, [system, {"role": "user", "content": q}], max_tokens, tools=TOOLS)
        for q in QUESTIONS
    ]
    return _summary(runs)


def _computed_tokens(url: str) -> int:
    """Prompt tokens the server computed since start (/health), 0 with the cache off."""
    with urllib.request.urlopen(url + "/health", timeout=10) as reply:
        return json.load(reply).get("prefix_cache", {}).get("computed_tokens", 0)


def conversation(url: str, max_tokens: int) -> dict:
    messages: list[dict] = []
    runs, computed = [], []
    for question in CHAT:
        messages.append({"role": "user", "content": question})
        before = _computed_tokens(url)
        run = chat_once(url, messages, max_tokens)
        computed.append(_computed_tokens(url) - before)
        runs.append(run)
        messages.append({"role": "assistant", "content": run.get("text", "")})
    return {**_summary(runs), "computed_tokens": computed}


def fresh(url: str, max_tokens: int) -> dict:
    runs = [chat_once(url, [{"role": "user", "content": q}], max_tokens) for q in FRESH]
    summary = _summary(runs)
    rates = [
        (r["tokens"] - 1) / (r["arrivals"][-1] - r["arrivals"][0])
        for r in runs
        if "error" not in r and len(r["arrivals"]) > 1 and r["arrivals"][-1] > r["arrivals"][0]
    ]
    summary["tokens_per_s_median"] = statistics.median(rates) if rates else None
    return summary


def _summary(runs: list[dict]) -> dict:
    errors = [r["error"] for r in runs if "error" in r]
    if errors:
        return {"error": "; ".join(errors[:3])}
    ttft = [r["ttft_ms"] for r in runs]
    prompts = [r["done"]["usage"]["prompt_tokens"] for r in runs]
    return {
        "ttft_ms": [round(t, 1) for t in ttft],
        "server_ttft_ms": [r["done"]["timings"]["ttft_ms"] for r in runs],
        "prompt_tokens": prompts,
        "first_ttft_ms": round(ttft[0], 1),
        "rest_ttft_ms_median": round(statistics.median(ttft[1:]), 1),
        "last_ttft_ms": round(ttft[-1], 1),
    }


WORKLOADS = {"one_tool": one_tool, "conversation": conversation, "fresh": fresh}
SETTINGS = {
    "cache on (default)": Setting(),
    "cache off": Setting(("--no-prefix-cache",)),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench --prefix", description=__doc__)
    parser.add_argument("--model", default="qwen-shape", help="as python -m bench --model")
    parser.add_argument("--fixture", default=None, help="as python -m bench --fixture")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per answer")
    parser.add_argument("--json", metavar="FILE", help="also write the report as JSON here")
    return parser


def main(argv: list[str]) -> int:
    from service.config import load_config

    args = build_parser().parse_args(argv)
    config = load_config([], os.environ)
    model = resolve_model(args.model, Path(config.cache_dir), args.fixture)
    report: dict = {"model": str(model), "load_average": os.getloadavg(), "settings": {}}
    with tempfile.TemporaryDirectory(prefix="deskchat-prefix-") as logs:
        for name, setting in SETTINGS.items():
            server = Server(model, Path(config.cache_dir), setting, Path(logs))
            try:
                server.wait_ready()
                report["settings"][name] = {
                    workload: run(server.url, args.max_tokens)
                    for workload, run in WORKLOADS.items()
                }
            finally:
                server.stop()
    report["load_average_after"] = os.getloadavg()
    print(json.dumps(report, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0
