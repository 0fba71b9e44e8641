"""`python -m bench`: the arguments, and which benchmark runs (side by side, --http,
--batch-curve, --latency, --speculation, --prefix, --long-prompt, --versus-server); the JSON
report written where --json says."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from bench.models import MODEL_HELP
from bench.peer_llamacpp import PEERS


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench",
        description="Measure deskchat's engine (as configured by DESKCHAT_* settings) against "
        "plain transformers (fp32 model.generate), alternating them in one run.",
    )
    parser.add_argument("--model", default="qwen-shape", help=MODEL_HELP)
    parser.add_argument(
        "--fixture",
        default=None,
        help="Qwen shape fixture folder [env DESKCHAT_QWEN_FIXTURE, or DESKCHAT_QWEN3_FIXTURE "
        "for a qwen3 shape; default ../shared/fixtures/qwen2.5-0.5b-instruct or qwen3-0.6b "
        "next to the repo]",
    )
    parser.add_argument("--rounds", type=int, default=3, help="passes over the prompt set")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per answer")
    parser.add_argument("--json", metavar="FILE", help="also write the report as JSON here")
    parser.add_argument(
        "--http", metavar="URL", help="measure a running server instead (POST URL/chat, streamed)"
    )
    parser.add_argument("--clients", type=int, default=1, help="with --http: concurrent clients")
    parser.add_argument(
        "--batch-curve",
        action="store_true",
        help="start server.py on --model once per --batches value and measure --http with "
        "each of --client-counts, plus a 1,000-token prompt arriving beside 3 streams",
    )
    parser.add_argument("--batches", default="1,4", help="with --batch-curve: --max-batch values")
    parser.add_argument(
        "--client-counts", default="1,2,4,8", help="with --batch-curve: concurrent clients"
    )
    parser.add_argument(
        "--latency",
        action="store_true",
        help="the latency benchmark instead: TTFT and inter-token gaps per server setting "
        "under CPU noise, bursts and memory pressure (python -m bench --latency --help)",
    )
    parser.add_argument(
        "--speculation",
        action="store_true",
        help="the speculative decoding benchmark instead: deskchat with and without "
        "--speculate (and llama.cpp with --peer) on grounded and open-chat prompts "
        "(python -m bench --speculation --help)",
    )
    parser.add_argument(
        "--prefix",
        action="store_true",
        help="the prefix cache benchmark instead: one tool's repeated system prompt, a "
        "12-exchange chat and fresh prompts, cache on and off (python -m bench --prefix --help)",
    )
    parser.add_argument(
        "--long-prompt",
        action="store_true",
        help="what a long prompt costs three streams answering beside it, by its length "
        "(python -m bench --long-prompt --help)",
    )
    parser.add_argument(
        "--versus-server",
        action="store_true",
        help="deskchat's server against llama-server instead, each alone at its defaults, "
        "through streamed /v1/chat/completions (python -m bench --versus-server --help)",
    )
    parser.add_argument(
        "--peer",
        choices=PEERS,
        help="also measure llama.cpp (llama-cpp-python) on the same weights as GGUF Q8_0 and "
        "Q4_K_M, in the same run (optional extra: pip install -r requirements-peer.txt)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--latency" in argv:  # its own options: bench/serving/latency.py
        from bench.serving import latency

        return latency.main([a for a in argv if a != "--latency"])
    if "--prefix" in argv:  # its own options: bench/serving/prefix.py
        from bench.serving import prefix

        return prefix.main([a for a in argv if a != "--prefix"])
    if "--long-prompt" in argv:  # its own options: bench/serving/long_prompt.py
        from bench.serving import long_prompt

        return long_prompt.main([a for a in argv if a != "--long-prompt"])
    if "--versus-server" in argv:  # its own options: bench/serving/versus.py
        from bench.serving import versus

        return versus.main([a for a in argv if a != "--versus-server"])
    if "--speculation" in argv:  # its own options: bench/compare/speculation.py
        from bench.compare import speculation

        return speculation.main([a for a in argv if a != "--speculation"])
    args = build_parser().parse_args(argv)
    from service.config import load_config

    config = load_config([], os.environ)
    if args.http:
        from bench.serving.http_client import run_http

        report = run_http(args.http, args.clients, args.rounds, args.max_tokens)
        print(json.dumps(report, indent=2))
    elif args.batch_curve:
        from bench.serving import batching

        report = batching.run(args, config)
    else:
        from bench.compare import side_by_side
        from bench.peer_llamacpp import PeerMissing
        from bench.qwen_shape import FixtureMissing

        try:
            report = side_by_side.run(args, config)
        except (FixtureMissing, PeerMissing) as exc:
            print(f"bench: {exc}", file=sys.stderr)
            return 2
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0
