"""`python -m bench --speculation` (also `python -m bench.compare.speculation`): exact
prompt-lookup speculative decoding against plain decoding, on the task set of
bench/speculation_tasks.py with the embedded model, greedy.

Sides, alternated request by request in one run (the order rotates), one busy at a time:
- deskchat_spec / deskchat_plain: `server.py --model <embedded> --speculate` and
  `--no-speculate` (bench/launcher.py), asked over streamed POST /chat, temperature 0.
- llamacpp_plain / llamacpp_lookup (`--peer llamacpp`): llama-cpp-python in this process on
  the GGUF the embedded model is converted from, `Llama.generate` greedy, plain and with
  `LlamaPromptLookupDecoding` as its draft model, given the prompt ids the server renders.
  Skipped, with the install hint, when llama_cpp does not import.

Decode tokens/s is (answer tokens - 1) / (first token to last), as in bench/compare/child.py;
for deskchat that time is total_ms - queued_ms - ttft_ms of the answer's timings. Acceptance
is answer tokens that came from accepted drafts over tokens proposed for verification;
tokens per step is answer tokens over the forward passes that produced them, the prompt's
(which gives the first token) included. deskchat reports these as `draft_tokens`,
`drafted_tokens` and `decode_steps` in its timings; where absent they show as unknown.
Answers stop at an end-of-generation token or max_tokens, that token counted, on every side.

Then four streams: per deskchat side, N clients at once, each through the grounded prompts
from its own offset; total answer tokens over wall time, the side order alternating by round.

Greedy text with and without speculation must be identical per prompt; any difference is an
engine bug and heads the report.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from bench.compare.speculation_report import (
    LLAMA_LOOKUP,
    LLAMA_PLAIN,
    PLAIN,
    SPEC,
    build_report,
    format_report,
)
from bench.launcher import ROOT, Server, Setting
from bench.models import resolve_model
from bench.peer_llamacpp import PEERS, PeerMissing, require_llama_cpp
from bench.serving.http_client import chat_once
from bench.speculation_tasks import TASKS, Task

SERVER_FLAGS = ("--request-timeout", "900")  # long answers under load are not refused


def speculate_flag_known() -> bool:
    """Whether this checkout's server takes --speculate (the engine change may not be in)."""
    from service.config import Config

    return any(f.name == "speculate" for f in dataclasses.fields(Config))


def _rate(tokens: int, seconds: float) -> float | None:
    return (tokens - 1) / seconds if tokens > 1 and seconds > 0 else None


# -- the sides ----------------------------------------------------------------------------------


class DeskchatSide:
    """A server.py process, asked over streamed POST /chat."""

    def __init__(self, name: str, server: Server):
        self.name = name
        self.server = server

    def run(self, task: Task, ids: list[int], max_tokens: int) -> dict:
        got = chat_once(self.server.url, task.messages, max_tokens, temperature=0)
        if "error" in got:
            return {"error": got["error"]}
        done = got["done"]
        timings = done.get("timings", {})
        tokens = done["usage"]["completion_tokens"]
        decode_s = (timings["total_ms"] - timings["queued_ms"] - timings["ttft_ms"]) / 1000
        return {
            "prompt_tokens": done["usage"]["prompt_tokens"],
            "tokens": tokens,
            "ttft_ms": timings["ttft_ms"],
            "decode_tok_s": _rate(tokens, decode_s),
            "draft_tokens": timings.get("draft_tokens"),
            "drafted_tokens": timings.get("drafted_tokens"),
            "decode_steps": timings.get("decode_steps"),
            "finish": done.get("finish_reason"),
            "text": got["text"],
        }


class LlamaSide:
    """llama.cpp on the embedded GGUF through `Llama.generate` (greedy), with or without its
    prompt-lookup draft model (counted_generate counts its passes and accepted drafts)."""

    def __init__(self, name: str, gguf: Path, threads: int, lookup_tokens: int = 0):
        from bench.peer_llamacpp import LlamaCppSide

        draft = None
        if lookup_tokens:
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

            draft = LlamaPromptLookupDecoding(num_pred_tokens=lookup_tokens)
        self.name = name
        self.lookup_tokens = lookup_tokens
        self.peer = LlamaCppSide(str(gguf), threads, draft_model=draft)
        self.eog = set(self.peer.eog)

    def describe(self) -> dict:
        return {
            **self.peer.describe(),
            "api": "Llama.generate, temp 0 (greedy)",
            "draft_model": f"LlamaPromptLookupDecoding(num_pred_tokens={self.lookup_tokens})"
            if self.lookup_tokens
            else None,
        }

    def run(self, task: Task, ids: list[int], max_tokens: int) -> dict:
        llm = self.peer.llm
        llm.reset()  # no KV reuse across requests: every prompt is prefilled whole
        started = time.perf_counter()
        out, accepted, feeds, first, last = counted_generate(llm, ids, max_tokens, self.eog)
        text = llm.detokenize([t for t in out if t not in self.eog])
        return {
            "prompt_tokens": len(ids),
            "tokens": len(out),
            "ttft_ms": (first - started) * 1000,
            "decode_tok_s": _rate(len(out), last - first),
            "draft_tokens": accepted,
            "drafted_tokens": sum(n - 1 for n in feeds[1:]),
            "decode_steps": len(feeds),
            "finish": "stop" if out and out[-1] in self.eog else "length",
            "text": text.decode("utf-8", errors="replace"),
        }


def counted_generate(llm, ids: list[int], max_tokens: int, eog: set[int]):
    """`llm.generate(ids)` greedy up to an end-of-generation token or max_tokens: the tokens,
    how many were accepted drafts, the tokens fed per forward pass (the prompt's first, then
    the last token and its drafts), and the perf_counter times of the first and last token.

    Token k of the answer sits at position len(ids) + k; when generate yields it, the
    positions up to `llm.n_tokens` hold what was fed, so it was drafted and accepted when
    such a position holds it. The answer's last token is not counted, as deskchat's engine
    does not count it (it stops verifying there)."""
    feeds: list[int] = []
    plain_eval = llm.eval

    def counted_eval(tokens):
        feeds.append(len(tokens))
        plain_eval(tokens)

    llm.eval = counted_eval  # generate calls self.eval once per forward pass
    out: list[int] = []
    accepted = 0
    first = last = time.perf_counter()
    try:
        for token in llm.generate(ids, temp=0.0, repeat_penalty=1.0):
            last = time.perf_counter()
            if not out:
                first = last
            at = len(ids) + len(out)
            out.append(token)
            if token in eog or len(out) >= max_tokens:
                break
            if at < llm.n_tokens and int(llm.input_ids[at]) == token:
                accepted += 1
    finally:
        del llm.eval
    return out, accepted, feeds, first, last


# -- the passes ---------------------------------------------------------------------------------


def one_stream(sides: dict, tasks: list[Task], ids: dict, rounds: int, max_tokens: int, log):
    """Every task on every side, `rounds` times; the side order rotates by request."""
    names = list(sides)
    runs = []
    for r in range(rounds):
        for i, task in enumerate(tasks):
            k = (r + i) % len(names)
            for name in names[k:] + names[:k]:
                result = sides[name].run(task, ids[task.name], max_tokens)
                result.update(side=name, task=task.name, kind=task.kind, round=r + 1)
                runs.append(result)
                log(run_line(result))
    return runs


def run_line(r: dict) -> str:
    head = f"  round {r['round']} {r['task']:26s} {r['side']:16s}"
    if "error" in r:
        return f"{head} ERROR {r['error']}"
    rate = r["decode_tok_s"]
    steps = f"{r['tokens'] / r['decode_steps']:.2f} tok/step" if r["decode_steps"] else ""
    return f"{head} {r['tokens']:4d} tok {rate or 0:7.2f} tok/s  {steps}"


def at_once(url: str, grounded: list[Task], streams: int, max_tokens: int):
    """`streams` clients released together, each through `grounded` from its own offset;
    their (task, answer) pairs and the wall time."""
    results: list[list[tuple[Task, dict]]] = [[] for _ in range(streams)]
    start = threading.Barrier(streams)

    def client(i: int) -> None:
        offset = i * len(grounded) // streams
        start.wait()
        for task in grounded[offset:] + grounded[:offset]:
            results[i].append((task, chat_once(url, task.messages, max_tokens, temperature=0)))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(streams)]
    began = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [pair for mine in results for pair in mine], time.perf_counter() - began


def four_streams(sides: dict, tasks: list[Task], rounds: int, max_tokens: int, streams: int, log):
    """Per round, each deskchat side in turn (the order alternating) under `streams` clients
    at once on the grounded tasks: total answer tokens / wall time."""
    grounded = [t for t in tasks if t.kind != "open"] or tasks
    names = list(sides)
    per_round = []
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            answers, wall = at_once(sides[name].server.url, grounded, streams, max_tokens)
            tokens = sum(got["tokens"] for _, got in answers if "error" not in got)
            row = {
                "side": name,
                "round": r + 1,
                "requests": len(answers),
                "errors": sum("error" in got for _, got in answers),
                "tokens": tokens,
                "wall_s": round(wall, 2),
                "total_tok_s": round(tokens / wall, 2),
                "texts": [[t.name, got["text"]] for t, got in answers if "error" not in got],
            }
            per_round.append(row)
            log(f"  {streams} streams round {r + 1} {name:16s} {row['total_tok_s']:7.2f} tok/s")
    return per_round


# -- a run --------------------------------------------------------------------------------------


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _commit() -> str:
    done = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    )
    return done.stdout.strip() or "unknown"


def _health(url: str) -> dict:
    with urllib.request.urlopen(url + "/health", timeout=10) as reply:
        return json.loads(reply.read())


def pick_tasks(spec: str | None) -> list[Task]:
    """All tasks, or those named (a task's name or kind, comma-separated)."""
    if not spec:
        return list(TASKS)
    wanted = [w for w in spec.split(",") if w]
    unknown = [w for w in wanted if all(w not in (t.name, t.kind) for t in TASKS)]
    if unknown:
        raise SystemExit(f"--tasks: unknown {', '.join(unknown)}")
    return [t for t in TASKS if t.name in wanted or t.kind in wanted]


def llama_sides(args, threads: int, log) -> tuple[dict, str | None]:
    """The two llama.cpp sides, or none and why (llama_cpp not installed)."""
    if not args.peer:
        return {}, None
    try:
        require_llama_cpp()
    except PeerMissing as exc:
        log(f"llama.cpp sides skipped: {exc}")
        return {}, str(exc)
    from inference.loading.embedded import gguf_path

    gguf = gguf_path()
    log(f"loading llama.cpp on {gguf} ...")
    return {
        LLAMA_PLAIN: LlamaSide(LLAMA_PLAIN, gguf, threads),
        LLAMA_LOOKUP: LlamaSide(LLAMA_LOOKUP, gguf, threads, args.lookup_tokens),
    }, None


def run(args, log) -> dict:
    from bench.compare.side_by_side import prompt_ids
    from service.config import load_config

    config = load_config([], os.environ)
    tasks = pick_tasks(args.tasks)
    model_dir = resolve_model("embedded", config.cache_dir, None)
    known = speculate_flag_known()
    if not known:
        log("!! this server has no --speculate yet: both deskchat sides run the same engine")
    settings = {
        SPEC: Setting(SERVER_FLAGS + (("--speculate",) if known else ())),
        PLAIN: Setting(SERVER_FLAGS + (("--no-speculate",) if known else ())),
    }
    meta = {
        "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "loadavg_start": [round(x, 2) for x in os.getloadavg()],
        "command": " ".join(["python -m bench.compare.speculation", *args.argv]),
        "commit": _commit(),
        "cpu_model": cpu_model(),
        "cpus": len(os.sched_getaffinity(0)),
        "threads": config.threads,
        "thread_policy": config.thread_policy,
        "model": str(model_dir),
        "rounds": args.rounds,
        "max_tokens": args.max_tokens,
        "tasks": len(tasks),
        "streams": args.streams,
        "speculate_flag": known,
        "servers": {name: s.describe() for name, s in settings.items()},
    }
    # A bench stopped with SIGTERM (timeout, kill) still stops the servers it started.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    logs = Path(tempfile.mkdtemp(prefix="deskchat-speculation-"))
    servers = {n: Server(model_dir, config.cache_dir, s, logs) for n, s in settings.items()}
    try:
        ids = prompt_ids(model_dir, {t.name: t.messages for t in tasks})
        llamas, skipped = llama_sides(args, config.threads, log)
        meta["llamacpp_skipped"] = skipped
        for server in servers.values():
            server.wait_ready()
        meta["health"] = {name: _health(s.url) for name, s in servers.items()}
        deskchat = {name: DeskchatSide(name, s) for name, s in servers.items()}
        sides = {**deskchat, **llamas}
        meta["llamacpp"] = {name: side.describe() for name, side in llamas.items()}
        for side in sides.values():  # warm-up, not measured
            side.run(tasks[0], ids[tasks[0].name], 8)
        log(f"one stream: {args.rounds} rounds x {len(tasks)} prompts x {len(sides)} sides")
        runs = one_stream(sides, tasks, ids, args.rounds, args.max_tokens, log)
        per_round = []
        if args.streams > 0:
            log(f"{args.streams} streams at once: {args.rounds} rounds x 2 sides")
            per_round = four_streams(
                deskchat, tasks, args.rounds, args.max_tokens, args.streams, log
            )
    finally:
        for server in servers.values():
            server.stop()
    meta["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    return build_report(meta, list(sides), runs, per_round, ids)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench --speculation",
        description=__doc__.split("\n\n")[0],
    )
    parser.add_argument("--rounds", type=int, default=3, help="passes over the task set")
    parser.add_argument("--max-tokens", type=int, default=160, help="most tokens per answer")
    parser.add_argument(
        "--peer",
        choices=PEERS,
        help="also llama.cpp on the embedded GGUF, plain and with its prompt lookup "
        "(pip install -r requirements-peer.txt); skipped with a message when not installed",
    )
    parser.add_argument(
        "--lookup-tokens", type=int, default=10, help="llama.cpp's num_pred_tokens per lookup"
    )
    parser.add_argument(
        "--streams", type=int, default=4, help="clients at once in the second pass (0: none)"
    )
    parser.add_argument(
        "--tasks", help="only these tasks: names or kinds, comma-separated [default: all]"
    )
    parser.add_argument("--out", type=Path, help="also write the report as JSON here")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    args.argv = argv
    report = run(args, log=lambda text: print(text, file=sys.stderr, flush=True))
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(format_report(report))
    return 1 if report["mismatches"] or report["errors"] else 0  # the report says which


if __name__ == "__main__":
    sys.exit(main())
