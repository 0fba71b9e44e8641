"""`python -m bench --versus-server`: deskchat against llama-server as a user sees them.

Each side runs alone (never both at once), on a free loopback port, at its shipped defaults:
`server.py --model DIR` (and the cache folder), and llama-server on the model's Q4_K_M GGUF
with the flags of bench/serving/llama_server.py. Once it is ready and has answered one
warm-up request, the client in this process (as a user's program on the same PC) sends
streamed, greedy `/v1/chat/completions`: (a) one user's answer of 128 tokens, its decode
rate (tokens after the first over the time from the first text chunk to the last); (b) 4
users at once, their tokens over the wall time; (c) the time to the first text chunk of a
short question and (d) of a ~1,300-token prompt, each prompt new (its own first sentence)
so no cache helps; (e) the server's own VmHWM at the end. Tokens are the server's usage.
Rounds alternate the sides (A B A B ...); the table gives each side's medians and the ratio
deskchat / llama-server, with the load averages around the run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.launcher import Server, Setting
from bench.models import MODEL_HELP, resolve_model
from bench.peer_llamacpp import PeerMissing
from bench.qwen_shape import FixtureMissing
from bench.serving import llama_server
from bench.serving.http_client import openai_once
from bench.serving.memory import long_prompt
from bench.stats import peak_rss_mb, percentile

SIDES = ("deskchat", "llama-server")
ANSWER_TOKENS = 128
USERS = 4
LONG_PROMPT_TOKENS = 1300
TTFT_TOKENS = 4  # answer length of the TTFT requests: only their first token is timed
SHORT_ASKS = 3  # TTFT requests per round and side
LONG_ASKS = 2
NOTED_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8")
READY_TIMEOUT_S = 3600  # a 3B shape's first load quantizes 36 layers on 2 cores
# workload -> (row label, unit, which way is better)
WORKLOADS = {
    "decode_tok_s": ("(a) one user's decode", "tok/s", "higher"),
    "users_tok_s": (f"(b) {USERS} users at once, total", "tok/s", "higher"),
    "ttft_short_ms": ("(c) TTFT, short prompt", "ms", "lower"),
    "ttft_long_ms": (f"(d) TTFT, ~{LONG_PROMPT_TOKENS:,}-token prompt", "ms", "lower"),
    "vmhwm_mb": ("(e) server's peak memory (VmHWM)", "MB", "lower"),
}


def write_long(tag: str) -> list[dict]:
    """A request whose answer runs long (random weights rarely stop anyway), new each time."""
    return [
        {
            "role": "user",
            "content": f"{tag}. Write a long, detailed story about an office that moves to a "
            "new building, with every step of the move.",
        }
    ]


def short_ask(tag: str) -> list[dict]:
    return [{"role": "user", "content": f"{tag}. What is the capital of France?"}]


def request(messages: list[dict], max_tokens: int) -> dict:
    """The same body to both sides: greedy, no field only one of them knows."""
    return {"model": "bench", "messages": messages, "max_tokens": max_tokens, "temperature": 0}


def decode_rate(result: dict) -> float:
    """Tokens after the first over the time from the first text chunk to the last."""
    span = result["arrivals"][-1] - result["arrivals"][0]
    return (result["tokens"] - 1) / span if span > 0 and result["tokens"] > 1 else float("nan")


def users_at_once(url: str, users: int, tag: str) -> tuple[float, list[dict]]:
    """Total completion tokens per second of `users` streams sent together, and the results."""
    results: list[dict] = [{} for _ in range(users)]

    def user(i: int) -> None:
        results[i] = openai_once(url, request(write_long(f"{tag}, user {i}"), ANSWER_TOKENS))

    threads = [threading.Thread(target=user, args=(i,)) for i in range(users)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - started
    tokens = sum(r.get("tokens", 0) for r in results)
    return tokens / wall, results


def measure(url: str, round_no: int) -> dict:
    """One side's samples of workloads (a) to (d) in one round, the prompts named by the
    round so both sides get the same ones; `errors` lists the requests that failed."""
    samples: dict[str, list[float]] = {key: [] for key in WORKLOADS if key != "vmhwm_mb"}
    errors: list[str] = []
    prompt_tokens: dict[str, list[int]] = {"short": [], "long": []}

    def sent(result: dict) -> dict | None:
        if "error" in result:
            errors.append(result["error"])
            return None
        return result

    one = sent(openai_once(url, request(write_long(f"Round {round_no}"), ANSWER_TOKENS)))
    if one:
        samples["decode_tok_s"].append(decode_rate(one))
    rate, results = users_at_once(url, USERS, f"Round {round_no}")
    if all([sent(r) for r in results]):  # every failure listed, not only the first
        samples["users_tok_s"].append(rate)
    asks = [("short", short_ask, SHORT_ASKS), ("long", _long_ask, LONG_ASKS)]
    for kind, make, count in asks:
        for i in range(count):
            tag = f"Round {round_no}, question {i}"
            result = sent(openai_once(url, request(make(tag), TTFT_TOKENS)))
            if result:
                samples[f"ttft_{kind}_ms"].append(result["ttft_ms"])
                prompt_tokens[kind].append(result["prompt_tokens"])
    answers = [r["tokens"] for r in (one, *results) if r and "tokens" in r]
    return {
        "samples": samples,
        "errors": errors,
        "prompt_tokens": prompt_tokens,
        "answer_tokens": answers,
    }


def _long_ask(tag: str) -> list[dict]:
    (message,) = long_prompt(LONG_PROMPT_TOKENS, 0)
    return [{"role": "user", "content": f"{tag}. {message['content']}"}]


def run_side(start, round_no: int, log) -> dict:
    """Start one side, wait, warm up, measure, read its VmHWM, stop it."""
    load_before = os.getloadavg()
    server = start()
    try:
        started = time.monotonic()
        server.wait_ready(READY_TIMEOUT_S)
        ready_s = time.monotonic() - started
        warm = openai_once(server.url, request(short_ask("Warm-up"), TTFT_TOKENS))
        if "error" in warm:
            raise RuntimeError(f"the warm-up request failed: {warm['error']}: {server.tail()}")
        run = measure(server.url, round_no)
        run["samples"]["vmhwm_mb"] = [peak_rss_mb(server.proc.pid)]
    finally:
        server.stop()
    run["ready_s"] = round(ready_s, 1)
    run["loadavg"] = [list(load_before), list(os.getloadavg())]
    log(f"  {json.dumps({k: [round(v, 1) for v in vs] for k, vs in run['samples'].items()})}")
    return run


def medians(runs: list[dict]) -> dict[str, float]:
    """Each workload's median over all its samples of all rounds (NaN when none)."""
    return {
        key: round(percentile([v for run in runs for v in run["samples"].get(key, [])], 50), 1)
        for key in WORKLOADS
    }


def ratios(by_side: dict[str, dict[str, float]]) -> dict[str, float]:
    """deskchat / llama-server per workload."""
    ours, theirs = by_side["deskchat"], by_side["llama-server"]
    return {k: round(ours[k] / theirs[k], 2) if theirs[k] else float("nan") for k in WORKLOADS}


def format_table(report: dict) -> str:
    meds, ratio, meta = report["medians"], report["ratios"], report["meta"]
    lines = [
        "| workload | deskchat | llama-server Q4_K_M | deskchat / llama-server | better |",
        "|---|---|---|---|---|",
    ]
    for key, (label, unit, better) in WORKLOADS.items():
        lines.append(
            f"| {label}, {unit} | {meds['deskchat'][key]:g} | {meds['llama-server'][key]:g} "
            f"| {ratio[key]:.2f}x | {better} |"
        )
    load = meta["loadavg_before"], meta["loadavg_after"]
    lines += [
        "",
        f"{meta['model']}, {meta['rounds']} rounds alternating {' / '.join(SIDES)}; medians; "
        f"load average (1, 5, 15 min) before {_load(load[0])}, after {_load(load[1])}; "
        f"{meta['errors']} failed requests",
    ]
    return "\n".join(lines)


def _load(values: list[float]) -> str:
    return " ".join(f"{v:.2f}" for v in values)


def cpu() -> dict:
    """The CPU's model name and the instruction sets that decide both sides' kernels."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {"cpu": platform.machine(), "cpu_flags": []}
    fields: dict[str, str] = {}
    for line in info.splitlines():  # the first CPU's fields
        key, colon, value = line.partition(":")
        if colon:
            fields.setdefault(key.strip(), value.strip())
    flags = set(fields.get("flags", "").split())
    return {
        "cpu": fields.get("model name", ""),
        "cpu_flags": [f for f in NOTED_FLAGS if f in flags],
    }


def run(args, log) -> dict:
    from service.config import load_config

    cache_dir = Path(args.cache_dir or load_config([], os.environ).cache_dir).expanduser()
    model = Path(resolve_model(args.model, cache_dir, args.fixture))
    gguf = llama_server.ensure_gguf(model, cache_dir, args.llama_server, log)
    meta = {
        "model": args.model,
        "model_dir": str(model),
        "gguf": str(gguf),
        "llama_server": f"{args.llama_server} {' '.join(llama_server.FLAGS)}",
        "rounds": args.rounds,
        "cpus": len(os.sched_getaffinity(0)),
        **cpu(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "loadavg_before": list(os.getloadavg()),
    }
    runs: dict[str, list[dict]] = {side: [] for side in SIDES}
    with tempfile.TemporaryDirectory(prefix="deskchat-versus-") as logs:
        starts = {
            "deskchat": lambda: Server(model, cache_dir, Setting(), Path(logs)),
            "llama-server": lambda: llama_server.start(args.llama_server, gguf, Path(logs)),
        }
        for round_no in range(args.rounds):
            for side in SIDES:
                log(f"round {round_no + 1}/{args.rounds}: {side}")
                runs[side].append(run_side(starts[side], round_no, log))
    meta["loadavg_after"] = list(os.getloadavg())
    meta["errors"] = sum(len(r["errors"]) for side in SIDES for r in runs[side])
    by_side = {side: medians(runs[side]) for side in SIDES}
    return {"meta": meta, "medians": by_side, "ratios": ratios(by_side), "runs": runs}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench --versus-server", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--model", default="qwen-shape", help=MODEL_HELP)
    parser.add_argument("--fixture", default=None, help="Qwen shape fixture folder")
    parser.add_argument(
        "--llama-server",
        required=True,
        metavar="PATH",
        help="llama.cpp's llama-server (llama-quantize beside it); docs/speed.md: how to build",
    )
    parser.add_argument("--rounds", type=int, default=3, help="rounds, each side once a round")
    parser.add_argument(
        "--cache-dir", default=None, help="models and GGUFs [default: the server's cache dir]"
    )
    parser.add_argument("--json", type=Path, help="also write the report as JSON here")
    return parser


def _log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        report = run(args, _log)
    except (FixtureMissing, PeerMissing) as exc:
        print(f"bench: {exc}", file=sys.stderr)
        return 2
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(format_table(report))
    return 1 if report["meta"]["errors"] else 0
