"""--prefix: what the shared prefix cache saves, measured through HTTP as a user sees it.

Three workloads on a server with the cache on (the default) and one with it off
(`--no-prefix-cache`), on the same model. (a) one tool sending the same long system prompt
and tool list with 20 different questions, and (b) a 12-exchange conversation, each request
carrying the whole history, three times (`--chats`), each time another team's, each
exchange's TTFT the median of the three: on each server in turn, the one before it up and
idle. (c) fresh prompts that share nothing, once both have run (a) and (b): each prompt on
one server then the other, `--rounds` times, so that each pair shares the machine's moment
(cache on / off is then the median over the pairs). On the random-weight shapes (b)'s
answers are whole words (`--word-answers`: `logit_bias`, the same on every server), so that,
resent, they read back as the tokens the server wrote, as a trained model's do. With
`--llama-server PATH`, (a) and (b) run a third time, alone, on llama-server at its defaults
(its prompt cache on, as it ships) with the flags of bench/serving/llama_server.py.
Every request is a streamed, greedy /v1/chat/completions from the same client
(bench/serving/http_client.py's openai_once), after one warm-up request per server; its
TTFT is the time to the first chunk that carries text or a tool call's piece. Reported:
each request's TTFT and the prompt tokens the server computed for it, for (c) tokens per
second too, and each server's VmHWM after (a) and (b), so the ratios the cache must meet
come from one run on one machine.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

from bench.launcher import Process, Server, Setting
from bench.models import MODEL_HELP, SHAPES, resolve_model
from bench.peer_llamacpp import PeerMissing
from bench.qwen_shape import FixtureMissing
from bench.serving import llama_server
from bench.serving.http_client import openai_once
from bench.serving.versus import READY_TIMEOUT_S, TTFT_TOKENS, decode_rate, request, short_ask
from bench.stats import peak_rss_mb

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
    "Let's plan the {team} team's office move. What should we do first?",
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
# (b)'s conversations, one each: no chat finds another's turns in a cache
TEAMS = ("accounts", "sales", "design", "support", "legal")
FRESH = [
    "Write a haiku about Monday mornings.",
    "List three uses for a paperclip.",
    "Explain what a spreadsheet is to a child.",
    "Give two tips for a tidy desk.",
    "What is a good name for a team of accountants?",
    "Describe the colour blue without naming it.",
]
TOOLS = [  # in /v1's shape, as an OpenAI client sends them
    {
        "type": "function",
        "function": {
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
DESKCHAT_ON, DESKCHAT_OFF, LLAMA = "cache on (default)", "cache off", "llama-server"
SETTINGS = {DESKCHAT_ON: Setting(), DESKCHAT_OFF: Setting(("--no-prefix-cache",))}


def _health(url: str) -> dict:
    with urllib.request.urlopen(url + "/health", timeout=10) as reply:
        return json.load(reply)


def _computed_tokens(url: str) -> int | None:
    """Prompt tokens deskchat computed since start (/health), None without its cache."""
    return _health(url).get("prefix_cache", {}).get("computed_tokens")


def ask(url: str, messages: list[dict], max_tokens: int, **fields) -> dict:
    """One request through openai_once, with `computed_tokens`: the prompt tokens the
    server computed for it (llama-server's timings say, deskchat's /health counter does;
    None when neither: deskchat with its cache off)."""
    before = _computed_tokens(url)
    run = openai_once(url, {**request(messages, max_tokens), **fields})
    if "error" not in run:
        after = _computed_tokens(url)
        if "prompt_n" in run["timings"]:
            run["computed_tokens"] = run["timings"]["prompt_n"]
        elif before is not None and after is not None:
            run["computed_tokens"] = after - before
        else:
            run["computed_tokens"] = None
    return run


def one_tool(url: str, max_tokens: int, questions: int = len(QUESTIONS)) -> dict:
    system = {"role": "system", "content": TOOL_RULES * 8}
    runs = [
        ask(url, [system, {"role": "user", "content": q}], max_tokens, tools=TOOLS)
        for q in QUESTIONS[:questions]
    ]
    return _summary(runs)


def conversation(
    url: str, max_tokens: int, exchanges: int = len(CHAT), chats: int = 3, **fields
) -> dict:
    """`chats` conversations one after another, each another team's. An exchange's TTFT is
    its median over them: one request's moves up to 30 % between runs on these PCs."""
    summaries = [chat(url, max_tokens, exchanges, team, **fields) for team in TEAMS[:chats]]
    if failed := [s for s in summaries if "error" in s]:
        return failed[0]
    times = zip(*(s["ttft_ms"] for s in summaries), strict=True)
    ttft = [statistics.median(each) for each in times]
    return {"chats": summaries, **_ttft_summary(ttft)}


def chat(url: str, max_tokens: int, exchanges: int, team: str, **fields) -> dict:
    """Each question with the whole history, the server's own answers in it."""
    messages: list[dict] = []
    runs = []
    for question in CHAT[:exchanges]:
        messages.append({"role": "user", "content": question.format(team=team)})
        run = ask(url, messages, max_tokens, **fields)
        runs.append(run)
        messages.append({"role": "assistant", "content": run.get("text", "")})
    return _summary(runs)


WORDS = 200  # the whole words --word-answers raises


def word_bias(model: Path, count: int = WORDS) -> dict[str, int]:
    """`logit_bias` of +100 on the tokenizer's first `count` tokens that are a space and a
    lowercase word of 3-8 letters and read back as themselves. A sequence of them decodes to
    text that encodes to the same tokens, as a trained model's answers mostly do; random
    weights' answers do not, so a conversation resending them computed each answer again
    (on the 0.5B shape, 36-52 tokens an exchange where the embedded model's took 15-21)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
    words = sorted(i for t, i in tokenizer.get_vocab().items() if re.fullmatch("Ġ[a-z]{3,8}", t))
    bare = partial(tokenizer.encode, add_special_tokens=False)
    itself = [i for i in words if bare(tokenizer.decode([i])).ids == [i]]
    if len(itself) < count:  # not a byte-level BPE vocabulary ("Ġword"): say so, not bias nothing
        raise SystemExit(
            f"--word-answers: {model}'s tokenizer has {len(itself)} whole-word tokens of the "
            f"kind it looks for, not {count}; run with --no-word-answers"
        )
    return {str(i): 100 for i in itself[:count]}


def fresh_side_by_side(urls: list[str], max_tokens: int, rounds: int) -> list[dict]:
    """(c) on servers that are all up, one request at a time: each fresh prompt on one, then
    on the next, the order reversed every other round, so that each prompt's answers share
    the machine's moment (the target is 3 %, and this VM moves 30 % between runs). Each
    round's prompts begin with its number: never in a cache from a round before."""
    runs: list[list[dict]] = [[] for _ in urls]
    order = list(range(len(urls)))
    for number in range(1, rounds + 1):
        for question in FRESH:
            asked = [{"role": "user", "content": f"{number}. {question}"}]
            for i in order:
                runs[i].append(ask(urls[i], asked, max_tokens))
        order.reverse()
    return [_fresh_summary(each) for each in runs]


def _fresh_summary(runs: list[dict]) -> dict:
    summary = _summary(runs)
    if "error" not in summary:
        rates = [decode_rate(r) for r in runs]  # NaN: an answer too short to time
        summary["tokens_per_s"] = [None if math.isnan(r) else round(r, 2) for r in rates]
        known = [r for r in rates if not math.isnan(r)]
        summary["tokens_per_s_median"] = round(statistics.median(known), 1) if known else None
    return summary


def paired_ratios(ours: dict, theirs: dict) -> dict:
    """The medians over (c)'s prompts of ours / theirs, each prompt against its own pair:
    TTFT (lower is better) and tokens a second (higher is)."""
    if "error" in ours or "error" in theirs:
        return {}
    pairs = {
        "ttft_ms": zip(ours["ttft_ms"], theirs["ttft_ms"], strict=True),
        "tokens_per_s": zip(ours["tokens_per_s"], theirs["tokens_per_s"], strict=True),
    }
    ratios = {key: [a / b for a, b in pair if a and b] for key, pair in pairs.items()}
    return {key: round(statistics.median(r), 3) if r else None for key, r in ratios.items()}


def _summary(runs: list[dict]) -> dict:
    errors = [r["error"] for r in runs if "error" in r]
    if errors:
        return {"error": "; ".join(errors[:3])}
    return {
        "server_ttft_ms": [r["timings"].get("ttft_ms") for r in runs],  # deskchat's own
        "prompt_tokens": [r["prompt_tokens"] for r in runs],
        "computed_tokens": [r["computed_tokens"] for r in runs],
        "completion_tokens": [r["tokens"] for r in runs],
        **_ttft_summary([r["ttft_ms"] for r in runs]),
    }


def _ttft_summary(ttft: list[float]) -> dict:
    return {
        "ttft_ms": [round(t, 1) for t in ttft],
        "first_ttft_ms": round(ttft[0], 1),
        "rest_ttft_ms_median": round(statistics.median(ttft[1:]), 1) if ttft[1:] else None,
        "last_ttft_ms": round(ttft[-1], 1),
    }


@contextlib.contextmanager
def serving(start: Callable[[], Process]) -> Iterator[Process]:
    """One server started, ready and warmed up by one short request; stopped after."""
    server = start()
    try:
        server.wait_ready(READY_TIMEOUT_S)
        warm = openai_once(server.url, request(short_ask("Warm-up"), TTFT_TOKENS))
        if "error" in warm:
            raise RuntimeError(f"the warm-up request failed: {warm['error']}: {server.tail()}")
        yield server
    finally:
        server.stop()


def run_workloads(server: Process, workloads: dict, log) -> dict:
    """(a) and (b) in order, then the server's VmHWM (and deskchat's /health prefix_cache):
    the cache at its fullest."""
    results: dict = {}
    for name, workload in workloads.items():
        log(f"  {name}")
        results[name] = workload(server.url)
    results["vmhwm_mb"] = round(peak_rss_mb(server.proc.pid), 1)
    if (cache := _health(server.url).get("prefix_cache")) is not None:
        results["prefix_cache"] = cache
    return results


def run(args, log) -> dict:
    from service.config import load_config

    cache_dir = Path(args.cache_dir or load_config([], os.environ).cache_dir).expanduser()
    model = Path(resolve_model(args.model, cache_dir, args.fixture))
    gguf = None
    if args.llama_server:  # converted before any server starts: a missing tool fails first
        gguf = llama_server.ensure_gguf(model, cache_dir, args.llama_server, log)
    word_answers = args.model in SHAPES if args.word_answers is None else args.word_answers
    answers = {"logit_bias": word_bias(model)} if word_answers else {}
    workloads = {
        "one_tool": lambda url: one_tool(url, args.max_tokens, args.questions),
        "conversation": lambda url: conversation(
            url, args.max_tokens, args.exchanges, args.chats, **answers
        ),
    }
    settings = dict(SETTINGS)
    if args.prefix_cache_mb:
        more = Setting(("--prefix-cache-mb", str(args.prefix_cache_mb)))
        settings[DESKCHAT_ON] = settings[DESKCHAT_ON] + more
    report: dict = {
        "model": str(model),
        "flags": {name: list(setting.flags) for name, setting in settings.items()},
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "load_average": os.getloadavg(),
        "word_answers": word_answers,
        "settings": {},
    }
    if gguf:
        report["gguf"] = str(gguf)
        report["flags"][LLAMA] = [str(args.llama_server), *llama_server.FLAGS]
    with tempfile.TemporaryDirectory(prefix="deskchat-prefix-") as logs:
        with contextlib.ExitStack() as up:  # each stays up, idle, while the next one runs
            urls = []
            for name, setting in settings.items():
                log(name)
                server = up.enter_context(
                    serving(partial(Server, model, cache_dir, setting, Path(logs)))
                )
                report["settings"][name] = run_workloads(server, workloads, log)
                urls.append(server.url)
            log(f"(c) fresh prompts on both, {args.rounds} rounds")
            fresh = fresh_side_by_side(urls, args.fresh_tokens, args.rounds)
            for name, summary in zip(settings, fresh, strict=True):
                report["settings"][name]["fresh"] = summary
        report["fresh_on_over_off"] = paired_ratios(*fresh)
        if gguf:
            log(LLAMA)
            start = partial(llama_server.start, args.llama_server, gguf, Path(logs))
            with serving(start) as server:
                report["settings"][LLAMA] = run_workloads(server, workloads, log)
    report["load_average_after"] = os.getloadavg()
    if gguf:
        report["ratios"] = ratios(report["settings"])
    return report


# (row label, workload, summary key) of the table, TTFT in ms
ROWS = [
    ("(a) one tool: first question", "one_tool", "first_ttft_ms"),
    ("(a) one tool: median of questions 2-{n}", "one_tool", "rest_ttft_ms_median"),
    ("(b) chat: exchange 1", "conversation", "first_ttft_ms"),
    ("(b) chat: median of exchanges 2-{n}", "conversation", "rest_ttft_ms_median"),
    ("(b) chat: exchange {n}", "conversation", "last_ttft_ms"),
    ("(c) fresh prompts: first", "fresh", "first_ttft_ms"),
    ("(c) fresh prompts: median of 2-{n}", "fresh", "rest_ttft_ms_median"),
]


def ratios(settings: dict) -> dict:
    """deskchat (cache on) / llama-server: each TTFT row of (a) and (b), and VmHWM; a row
    either side lacks (failed) has none."""
    ours, theirs = settings[DESKCHAT_ON], settings[LLAMA]
    out = {}
    for _label, workload, key in ROWS:
        a, b = ours.get(workload, {}).get(key), theirs.get(workload, {}).get(key)
        if a and b:
            out[f"{workload}.{key}"] = round(a / b, 2)
    if ours.get("vmhwm_mb") and theirs.get("vmhwm_mb"):
        out["vmhwm_mb"] = round(ours["vmhwm_mb"] / theirs["vmhwm_mb"], 2)
    return out


def _cell(summary: dict | None, key: str) -> str:
    if not summary:
        return ""
    if "error" in summary:
        return "failed"
    value = summary.get(key)
    return "" if value is None else f"{value:,.1f}"


def format_table(report: dict) -> str:
    settings = report["settings"]
    names = list(settings)
    ratio = report.get("ratios", {})
    head = ["TTFT, ms", *names] + (["cache on / llama-server"] if LLAMA in names else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, workload, key in ROWS:
        counts = [
            len(s[workload]["ttft_ms"])
            for s in settings.values()
            if "ttft_ms" in s.get(workload, {})
        ]
        cells = [_cell(settings[n].get(workload), key) for n in names]
        if LLAMA in names:
            cells.append(
                f"{ratio[f'{workload}.{key}']:.2f}x" if f"{workload}.{key}" in ratio else ""
            )
        lines.append(f"| {label.format(n=max(counts, default=0))} | " + " | ".join(cells) + " |")
    rates = [_cell(settings[n].get("fresh"), "tokens_per_s_median") for n in names]
    memory = [_cell(settings[n], "vmhwm_mb") for n in names]
    if LLAMA in names:
        rates.append("")
        memory.append(f"{ratio['vmhwm_mb']:.2f}x" if "vmhwm_mb" in ratio else "")
    lines.append("| (c) fresh prompts: median tokens/s | " + " | ".join(rates) + " |")
    lines.append("| server's VmHWM after (a) and (b), MB | " + " | ".join(memory) + " |")
    if paired := report.get("fresh_on_over_off"):
        shown = {k: "none" if v is None else f"{v:.3f}x" for k, v in paired.items()}
        lines += [
            "",
            f"(c), cache on / off, each prompt against its pair (medians): TTFT "
            f"{shown['ttft_ms']}, tokens/s {shown['tokens_per_s']}",
        ]
    load = " ".join(f"{v:.2f}" for v in report["load_average"])
    after = " ".join(f"{v:.2f}" for v in report["load_average_after"])
    lines += ["", f"{report['model']}; load average (1, 5, 15 min) before {load}, after {after}"]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench --prefix", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--model", default="qwen-shape", help=MODEL_HELP)
    parser.add_argument("--fixture", default=None, help="as python -m bench --fixture")
    parser.add_argument("--max-tokens", type=int, default=32, help="(a), (b): tokens an answer")
    parser.add_argument(
        "--llama-server",
        metavar="PATH",
        help="also run (a) and (b) on llama.cpp's llama-server (llama-quantize beside it) at "
        "its defaults, on the model's Q4_K_M GGUF; docs/speed.md: how to build it",
    )
    parser.add_argument(
        "--prefix-cache-mb",
        type=int,
        metavar="MB",
        help="deskchat's --prefix-cache-mb with the cache on [default: the server's]",
    )
    for flag, items, what in [
        ("--questions", QUESTIONS, "(a)'s questions"),
        ("--exchanges", CHAT, "(b)'s exchanges"),
    ]:
        parser.add_argument(
            flag,
            type=int,
            default=len(items),
            choices=range(2, len(items) + 1),
            metavar=f"2..{len(items)}",
            help=f"{what}: the first N (fewer for a smoke run) [default: {len(items)}]",
        )
    parser.add_argument(
        "--rounds",
        type=int,
        default=4,
        choices=range(2, 11, 2),
        metavar="2|4|6|8|10",
        help=f"(c)'s rounds of its {len(FRESH)} fresh prompts on both settings, each "
        "setting first in every other one [default: 4]",
    )
    parser.add_argument(
        "--fresh-tokens",
        type=int,
        default=128,
        choices=range(2, 4097),
        metavar="2..4096",
        help="(c)'s tokens per answer: its tokens/s is timed over them [default: 128; a "
        "32-token answer of the embedded model lasts 0.2 s, and pairs of them moved 0.86-1.25x]",
    )
    parser.add_argument(
        "--chats",
        type=int,
        default=3,
        choices=range(1, len(TEAMS) + 1),
        metavar=f"1..{len(TEAMS)}",
        help="(b)'s conversations, each exchange's TTFT the median over them [default: 3]",
    )
    parser.add_argument(
        "--word-answers",
        action=argparse.BooleanOptionalAction,
        default=None,
        help=f"(b)'s answers only of {WORDS} whole-word tokens (logit_bias), so that they "
        "read back as the tokens the server wrote [default: on for the random-weight "
        "shapes, whose answers otherwise do not, off for real models]",
    )
    parser.add_argument(
        "--cache-dir", default=None, help="models and GGUFs [default: the server's cache dir]"
    )
    parser.add_argument("--json", metavar="FILE", help="also write the report as JSON here")
    return parser


def _log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        report = run(args, _log)
    except (FixtureMissing, PeerMissing) as exc:
        print(f"bench: {exc}", file=sys.stderr)
        return 2
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    print(format_table(report))
    failed = [
        n
        for n, s in report["settings"].items()
        for w in s.values()
        if isinstance(w, dict) and "error" in w
    ]
    return 1 if failed else 0
