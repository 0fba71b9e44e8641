"""`python -m bench --latency`: the spread a user feels, per server setting and per condition.

For each setting (server flags, environment, priority) it starts `server.py` on a free
loopback port, warms it up, then for each condition (bench/serving/noise.py) sends short streamed
`POST /chat` requests one after another for `--seconds`, recording each request's time to
the first token (TTFT) and every gap between two text events. The server sends one event a
step, so a step that takes drafted tokens sends them in one event: the gaps are the steps'
pace as a reader sees it, and the tokens a step took (the server's counts) and the time a
token took (an answer's time after its first text event over its tokens after the first)
say what the steps held. One table per run: settings x conditions, with
p50 / p90 / p99 / p99.9 / max and the jitter ratio p99/p50, the settings of each row and the
load average around each cell. `--json` keeps it all; `--merge` prints several runs' JSON as
one table (system/measure-tuning.sh: tuned and untuned).
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import os
import platform
import sys
import tempfile
import time
import zlib
from pathlib import Path

from bench import first_token
from bench.engine import machine_floor
from bench.launcher import Server, Setting, client_priority, profile_environment, profile_nice
from bench.models import MODEL_HELP, resolve_model
from bench.serving.http_client import chat_once, gaps_ms
from bench.serving.noise import CONDITIONS, Noise, busy_programs
from bench.speculation_tasks import GROUNDED_KINDS, TASKS
from bench.stats import QUANTILES, percentile, summary

WARMUP_REQUESTS = 1
SETTLE_S = 1.0  # noise running before the first measured request
FLOOR_S = 10.0  # the machine's floor (bench/engine/machine_floor.py), after each cell
# A question whose answer runs past 64 tokens on a real instruct model (the embedded one
# stops after 7 tokens on "What is the capital of France?"), so every request gives gaps.
ASK = [
    {
        "role": "user",
        "content": "Write a Python function that reads a CSV file, groups the rows by the "
        "second column and averages the third. Explain each line.",
    }
]
ASKS = ("question", *GROUNDED_KINDS, "open")  # --ask: ASK, or a kind of the speculation tasks


def questions(ask: str) -> list[list[dict]]:
    """The messages the requests cycle through: ASK alone, or every speculation task of a
    kind (grounded ones copy their prompt, so their steps take drafted tokens)."""
    if ask == "question":
        return [ASK]
    return [task.messages for task in TASKS if task.kind == ask]


def _upper_half() -> str:
    """The upper half of this process's CPUs (at least one): the inference side of `pinned`."""
    cpus = sorted(os.sched_getaffinity(0))
    return ",".join(str(c) for c in cpus[len(cpus) // 2 :])


# The busy programs of the cpu and bursts conditions: a profile's share is weighed against
# all of them (launcher.profile_nice).
BUSY = busy_programs()
SETTINGS: dict[str, Setting] = {
    "default": Setting(about="the server's defaults"),
    "gc-python": Setting(("--gc-policy", "python"), about="Python's own GC thresholds"),
    "threads-1": Setting(("--threads", "1"), about="one inference thread"),
    "threads-fixed": Setting(
        ("--thread-policy", "fixed"), about="--threads always, whatever the contention"
    ),
    "threads-adaptive": Setting(
        ("--thread-policy", "adaptive"), about="one thread while others take the CPUs"
    ),
    "omp-passive": Setting(env={"OMP_WAIT_POLICY": "PASSIVE"}, about="OpenMP threads sleep"),
    "omp-active": Setting(env={"OMP_WAIT_POLICY": "ACTIVE"}, about="OpenMP threads spin"),
    "pinned": Setting(("--cpu-affinity", _upper_half()), about="inference on the upper CPUs"),
    "mlock": Setting(("--mlock",), about="resident memory locked"),
    "slice-default": Setting(
        ("--sched-slice-us", "0"), about="the kernel's scheduler slice, whatever the profile's"
    ),
    "no-realtime": Setting(
        ("--realtime-first-step-ms", "0"), about="no real-time first step, whatever the profile's"
    ),
    "shared-desk": Setting(
        env=profile_environment("shared-desk"),
        nice=profile_nice("shared-desk", BUSY),
        about="profile: the owner first (its environment, its slice's CPUWeight= as a nice)",
    ),
    "dedicated": Setting(
        env=profile_environment("dedicated-pc"),
        nice=profile_nice("dedicated-pc", BUSY),
        about="profile: the service first (its environment, its slice's CPUWeight= as a nice)",
    ),
    "no-speculate": Setting(("--no-speculate",), about="no drafted tokens"),
}
# The omp-* settings are left out: OMP_WAIT_POLICY governs torch's OpenMP threads, which the
# native step does not use (torch runs on one thread beside it); they remain for the torch step.
FULL_TABLE = (
    "default",
    "gc-python",
    "threads-1",
    "threads-fixed",
    "no-speculate",
    "pinned",
    "mlock",
    "shared-desk",
    "dedicated",
    "dedicated+threads-1",
)


def setting(name: str) -> Setting:
    """A setting by name; 'a+b' combines them (b's priority wins)."""
    combined = Setting()
    for part in name.split("+"):
        if part not in SETTINGS:
            raise SystemExit(f"--settings: unknown {part!r}; known: {', '.join(SETTINGS)}")
        combined = combined + SETTINGS[part]
    return combined


# -- one streamed request ----------------------------------------------------------------------


def stream_once(
    url: str,
    max_tokens: int,
    messages: list[dict] = ASK,
    timeout: float = 300,
    waits: first_token.Waits | None = None,
) -> dict:
    """{ttft_ms, gaps_ms: [...], tokens, steps, ms_a_token} or {error}. `steps` is the
    server's count of the answer's steps; `ms_a_token` the time from the first text event to
    the end over the tokens after the first (None for an answer of one token or one event:
    text held back to the end has no pace to show). With `waits` (the bench started the
    server), also `first_token`: where the first token's time went."""
    before, after = (waits.now() if waits else None), []
    on_first = (lambda: after.append(waits.now())) if waits else None
    result = chat_once(url, messages, max_tokens, timeout, on_first=on_first)
    if "error" in result:
        return result
    arrivals = result["arrivals"]
    if not arrivals:
        return {"error": "no token"}
    tokens = result["tokens"]
    after_first_ms = result["latency_s"] * 1000 - result["ttft_ms"]
    timings = result["done"]["timings"]
    measured = {
        "ttft_ms": result["ttft_ms"],
        "gaps_ms": gaps_ms(arrivals),
        "tokens": tokens,
        "steps": timings["decode_steps"],
        "ms_a_token": after_first_ms / (tokens - 1) if tokens > 1 and len(arrivals) > 1 else None,
    }
    if after:
        measured["first_token"] = first_token.parts(result["ttft_ms"], timings, before, after[0])
    return measured


def measure(
    url: str, seconds: float, max_tokens: int, ask: str = "question", server_pid: int | None = None
) -> dict:
    """Requests one after another for `seconds`, cycling through the ask's questions; their
    TTFTs and event gaps summarized, the tokens a step took (drafted tokens come in their
    step's one event) and the median time a token took; with the server's process id, where
    the first tokens' time went (bench/first_token.py)."""
    parts: list[dict] = []
    ttft: list[float] = []
    gaps: list[float] = []
    tokens = steps = 0
    per_token: list[float] = []
    errors = 0
    asked = questions(ask)
    end = time.monotonic() + seconds
    opened = first_token.Waits(server_pid) if server_pid else contextlib.nullcontext()
    with opened as waits:
        while time.monotonic() < end:
            messages = asked[(len(ttft) + errors) % len(asked)]
            result = stream_once(url, max_tokens, messages, waits=waits)
            if "error" in result:
                errors += 1
                continue
            if "first_token" in result:
                parts.append(result["first_token"])
            ttft.append(result["ttft_ms"])
            gaps.extend(result["gaps_ms"])
            tokens, steps = tokens + result["tokens"], steps + result["steps"]
            if result["ms_a_token"] is not None:
                per_token.append(result["ms_a_token"])
    cell = {
        "ttft_ms": summary(ttft),
        "gap_ms": summary(gaps),
        "tokens_per_step": round(tokens / steps, 2) if steps else None,
        "ms_a_token": round(percentile(per_token, 50), 2) if per_token else None,
        "errors": errors,
    }
    if parts:
        cell["first_token"] = first_token.summarize(parts)
    return cell


# -- a run -----------------------------------------------------------------------------------


def run_cell(
    url: str, condition: str, args, file: Path, log, floor=None, server_pid: int | None = None
) -> dict:
    """One condition's requests; then `floor(cell)` (the machine's floor: its result goes in
    the cell) while the condition's noise still runs. `server_pid`: the server the bench
    started, whose threads' waits the first tokens' parts read."""
    load_before = os.getloadavg()[0]
    bound_s = args.seconds + SETTLE_S + 60  # the noise ends by itself even if we hang
    if floor:
        bound_s += FLOOR_S + machine_floor.START_S
    with Noise(condition, bound_s, memory_cap_mb=args.memory_mb, file=file) as n:
        if n.report:
            log(f"    memory: {n.report}")
        time.sleep(SETTLE_S if condition != "quiet" else 0)
        cell = measure(url, args.seconds, args.max_tokens, args.ask, server_pid)
        if floor:
            cell["floor"] = floor(cell)
            if any(proc.poll() is not None for proc in n.procs):
                cell["floor"] = {"error": "the noise ended before the floor did"}
    cell["loadavg_1m"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    cell["noise"] = n.report or condition
    return cell


def floor_for(chosen: Setting, condition: str, quiet: dict | None):
    """What measures the machine's floor after a cell of `chosen` (run_cell's `floor`): after
    the quiet cell, samples as long as its gap p50; beside noise, the quiet floor's repeats
    (the same work), with their p50 and p99 over the quiet floor's p50 (`vs_quiet`, as the
    gaps are compared). None for a noise cell without a quiet floor before it."""
    if condition == "quiet":
        return lambda cell: machine_floor.beside(chosen, cell["gap_ms"]["p50"], FLOOR_S)
    if not quiet or "error" in quiet:
        return None

    def beside_noise(_cell: dict) -> dict:
        base = quiet["sample_ms"]["p50"]
        measured = machine_floor.beside(chosen, base, FLOOR_S, repeats=quiet["repeats"])
        if "error" not in measured:
            measured["vs_quiet"] = [
                round(measured["sample_ms"][q] / base, 2) for q in ("p50", "p99")
            ]
        return measured

    return beside_noise


def run(args, log=print) -> dict:
    from service.config import load_config

    config = load_config([], os.environ)
    report = {"meta": meta(args), "settings": {}, "cells": {}}
    file = config.cache_dir / "bench-pagecache.bin"
    with tempfile.TemporaryDirectory(prefix="deskchat-latency-") as logs:
        for name in args.settings:
            label = f"{args.label}: {name}" if args.label else name
            chosen = setting(name)
            report["settings"][label] = chosen.describe()
            url = args.url
            server = None
            if not url:
                model = resolve_model(args.model, config.cache_dir, None)
                server = Server(model, config.cache_dir, chosen, Path(logs))
                url = server.url
            try:
                log(f"{label}: {chosen.describe()}")
                if server:
                    server.wait_ready()
                for _ in range(WARMUP_REQUESTS):
                    stream_once(url, args.max_tokens)
                quiet = None  # this setting's quiet floor, once measured
                pid = server.proc.pid if server else None  # its threads' waits are read
                for condition in args.conditions:
                    floor = floor_for(chosen, condition, quiet)
                    with client_priority(chosen.nice, chosen.slice_us()):
                        cell = run_cell(url, condition, args, file, log, floor, pid)
                    if condition == "quiet":
                        quiet = cell["floor"]
                    report["cells"].setdefault(label, {})[condition] = cell
                    log(f"  {condition:7s} {cell_text(cell)}  load {cell['loadavg_1m']}")
            finally:
                if server:
                    server.stop()
    report["meta"]["loadavg_1m_end"] = round(os.getloadavg()[0], 2)
    return report


# Where a kernel's build configuration may be read: its own copy, else the distribution's.
KERNEL_CONFIGS = (Path("/proc/config.gz"), Path(f"/boot/config-{platform.release()}"))


def kernel_hz(configs: tuple[Path, ...] = KERNEL_CONFIGS) -> int | None:
    """The kernel's tick rate (CONFIG_HZ) from its build configuration, None where no
    readable copy says. The runs depend on it: the kernel bounds what a group may be owed,
    one of the things a wake-up beside busy programs waits for, by max(two slices, a tick)
    (docs/latency.md): a tick at the dedicated profile's 100 us slice."""
    for path in configs:
        try:
            raw = path.read_bytes()
            text = (gzip.decompress(raw) if path.suffix == ".gz" else raw).decode(errors="replace")
        except (OSError, EOFError, gzip.BadGzipFile, zlib.error):
            continue
        for line in text.splitlines():
            if line.startswith("CONFIG_HZ="):
                with contextlib.suppress(ValueError):
                    return int(line.split("=", 1)[1])
    return None


def meta(args) -> dict:
    return {
        "model": args.url or args.model,
        "seconds_per_cell": args.seconds,
        "max_tokens": args.max_tokens,
        "ask": args.ask,
        "cpus": len(os.sched_getaffinity(0)),
        "kernel": platform.release(),
        "kernel_hz": kernel_hz(),
        "memory_cap_mb": args.memory_mb,
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "loadavg_1m_start": round(os.getloadavg()[0], 2),
    }


# -- the table -----------------------------------------------------------------------------------


def cell_text(cell: dict) -> str:
    gap, ttft = cell["gap_ms"], cell["ttft_ms"]
    return (
        f"gap {gap['p50']:g}/{gap['p99']:g} ms (x{gap['jitter']:g}), "
        f"TTFT {ttft['p50']:g}/{ttft['p99']:g} ms{_floor_text(cell)}"
    )


def _floor_text(cell: dict) -> str:
    """', floor x1.3': the p99/p50 of the machine's fixed loop after a quiet cell; beside
    noise ', floor 1.3x/2.5x': its p50 and p99 over the quiet floor's p50."""
    if not cell.get("floor"):
        return ""
    measured = cell["floor"]
    if "error" in measured:
        return f", floor: {measured['error']}"
    if "vs_quiet" in measured:
        p50, p99 = measured["vs_quiet"]
        return f", floor {p50:g}x/{p99:g}x"
    return f", floor x{measured['sample_ms']['jitter']:g}"


def format_report(report: dict) -> str:
    """The compact table (settings x conditions), the full table, and the legend."""
    cells = report["cells"]
    conditions = [c for c in CONDITIONS if any(c in row for row in cells.values())]
    lines = [
        "inter-token gap p50/p99 ms (p99/p50) · TTFT p50/p99 ms; the machine's floor (a "
        "fixed loop, bench/engine/machine_floor.py): quiet, its p99/p50; beside noise, the "
        "same work's p50 and p99 over the quiet floor's p50",
        "",
        "| setting | " + " | ".join(conditions) + " |",
        "|---|" + "---|" * len(conditions),
    ]
    for label, row in cells.items():
        texts = [
            f"{row[c]['gap_ms']['p50']:g}/{row[c]['gap_ms']['p99']:g} "
            f"(x{row[c]['gap_ms']['jitter']:g}) · "
            f"{row[c]['ttft_ms']['p50']:g}/{row[c]['ttft_ms']['p99']:g}{_floor_text(row[c])}"
            if c in row
            else "-"
            for c in conditions
        ]
        lines.append(f"| {label} | " + " | ".join(texts) + " |")
    quant = [f"p{q:g}" for q in QUANTILES] + ["max", "p99/p50"]
    lines += [
        "",
        "| setting | condition | requests | errors | gap ms "
        + " / ".join(quant)
        + " | gaps | tokens a step, ms a token | TTFT ms "
        + " / ".join(quant)
        + " | load 1m before, after |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for label, row in cells.items():
        for condition, cell in row.items():
            gap, ttft = cell["gap_ms"], cell["ttft_ms"]
            steps = ", ".join(  # runs before they were measured lack them
                "-" if cell.get(key) is None else f"{cell[key]:g}"
                for key in ("tokens_per_step", "ms_a_token")
            )
            lines.append(
                f"| {label} | {condition} | {ttft['n']} | {cell['errors']} | {_quants(gap)} "
                f"| {gap['n']} | {steps} | {_quants(ttft)} | {cell['loadavg_1m'][0]}, "
                f"{cell['loadavg_1m'][1]} |"
            )
    lines += versus_quiet_lines(cells)
    lines += first_token.table_lines(cells)
    lines += ["", "Settings:"]
    lines += [f"- {label}: {text}" for label, text in report["settings"].items()]
    metas = report.get("metas", [report.get("meta", {})])
    lines += ["", "Run: " + "; ".join(json.dumps(m, sort_keys=True) for m in metas)]
    return "\n".join(lines)


def versus_quiet_lines(cells: dict) -> list[str]:
    """Each noise cell against its setting's quiet cell: the ratios docs/latency.md holds
    the targets to, until now worked out by hand from the tables. The TTFT p99 over the
    quiet p99 as well: the quiet cell's own tail is most of a first token's budget. Nothing
    for a setting without a quiet cell."""
    lines = []
    for label, row in cells.items():
        quiet = row.get("quiet")
        if not quiet:
            continue
        gap50, ttft = quiet["gap_ms"]["p50"], quiet["ttft_ms"]
        floor = quiet.get("floor") or {}
        floor_jitter = floor.get("sample_ms", {}).get("jitter")
        steady = f"{quiet['gap_ms']['jitter']:g}" + (
            f" (the floor's {floor_jitter:g})" if floor_jitter else ""
        )
        for condition, cell in row.items():
            if condition == "quiet":
                continue
            gap, noisy = cell["gap_ms"], cell["ttft_ms"]
            lines.append(
                f"| {label} | {condition} | {_ratio(gap['p50'], gap50)} / "
                f"{_ratio(gap['p99'], gap50)} | {_ratio(noisy['p99'], ttft['p50'])} / "
                f"{_ratio(noisy['p99'], ttft['p99'])} | {steady} "
                f"| {gap['max']:g}, {noisy['max']:g} |"
            )
    if not lines:
        return []
    return [
        "",
        "Beside the noise, against the same setting's quiet cell (the targets: docs/latency.md)",
        "",
        "| setting | condition | gap p50 / p99 over the quiet gap p50 | TTFT p99 over the "
        "quiet TTFT p50 / p99 | quiet gap p99/p50 | longest gap, slowest first token ms |",
        "|---|---|---|---|---|---|",
        *lines,
    ]


def _ratio(value: float, base: float) -> str:
    """'1.23x', or '-' over a base of 0 (a stream whose events came bunched)."""
    return f"{value / base:.2f}x" if base else "-"


def _quants(s: dict) -> str:
    return " / ".join(f"{s[k]:g}" for k in (*(f"p{q:g}" for q in QUANTILES), "max", "jitter"))


def merge(paths: list[Path]) -> dict:
    """Several runs' JSON as one report: their rows in order, their metas kept."""
    merged: dict = {"settings": {}, "cells": {}, "metas": []}
    for path in paths:
        part = json.loads(path.read_text())
        merged["settings"].update(part["settings"])
        merged["cells"].update(part["cells"])
        merged["metas"].extend(part.get("metas", [part.get("meta", {})]))
    return merged


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench --latency",
        description=__doc__.split("\n\n")[0],
        epilog="Settings: "
        + "; ".join(f"{k}: {v.describe()}" for k, v in SETTINGS.items())
        + ". Join with '+' to combine (dedicated+pinned).",
    )
    parser.add_argument(
        "--settings",
        default=",".join(FULL_TABLE),
        type=lambda text: [s for s in text.split(",") if s],
        help="comma-separated server settings, one row each [default: the full table]",
    )
    parser.add_argument(
        "--conditions",
        default=",".join(CONDITIONS),
        type=lambda text: [c for c in text.split(",") if c],
        help=f"comma-separated, of {', '.join(CONDITIONS)} [default: all]",
    )
    parser.add_argument("--seconds", type=float, default=60, help="of requests per cell")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per answer")
    parser.add_argument("--model", default="qwen-shape", help=MODEL_HELP)
    parser.add_argument(
        "--ask",
        default="question",
        choices=ASKS,
        help="what the requests ask: one code question (its answer runs past 64 tokens), "
        "or the speculation bench's tasks of a kind (the grounded ones draft) [question]",
    )
    parser.add_argument("--url", help="measure this running server instead (one row)")
    parser.add_argument(
        "--memory-mb",
        type=int,
        default=None,
        help="memory condition: take at most this much [default: MemAvailable less a margin]",
    )
    parser.add_argument("--label", default="", help="prefix of the row names (tuned, ...)")
    parser.add_argument("--json", type=Path, help="also write the report as JSON here")
    parser.add_argument(
        "--merge", type=Path, nargs="+", help="print these JSON reports as one table; no run"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.merge:
        print(format_report(merge(args.merge)))
        return 0
    unknown = set(args.conditions) - set(CONDITIONS)
    if unknown:
        raise SystemExit(f"--conditions: unknown {', '.join(sorted(unknown))}")
    for name in args.settings:
        setting(name)  # fail on a typo before anything starts
    if args.url:
        args.settings = ["external"]
        SETTINGS["external"] = Setting(about=f"the server at {args.url}, as it runs")
    report = run(args, log=lambda text: print(text, file=sys.stderr, flush=True))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(format_report(report))
    return 0
