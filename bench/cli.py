"""`python -m bench`: argument parsing, the two child processes, the table and the JSON."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from bench.prompts import CORE, PROMPTS
from bench.stats import SUMMARY_KEYS, percentile, summarize

SIDES = ("engine", "baseline")


class Child:
    """A bench/child.py process speaking JSON lines."""

    def __init__(self, side: str, model_dir: Path, threads: int):
        self.side = side
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "bench.child",
                "--side",
                side,
                "--model-dir",
                str(model_dir),
                "--threads",
                str(threads),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=Path(__file__).resolve().parent.parent,
        )
        self.hello = self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the {self.side} process ended early (see its log above)")
        return json.loads(line)

    def ask(self, **command) -> dict:
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)


def resolve_model(spec: str, cache_dir: Path, fixture: str | None) -> Path:
    if spec == "embedded":
        from inference.embedded import embedded_model_dir

        return embedded_model_dir(cache_dir)
    if spec == "qwen-shape":
        from bench.qwen_shape import fixture_dir, qwen_shape_dir

        return qwen_shape_dir(cache_dir, fixture_dir(fixture))
    path = Path(spec).expanduser()
    if not (path / "config.json").is_file():
        raise SystemExit(f"--model {spec}: not a Hugging Face model folder (no config.json)")
    return path


def run_side_by_side(
    model_dir: Path, rounds: int, max_tokens: int, threads: int, log=print
) -> dict:
    """Load each side in turn (alone on the CPU), then alternate them request by request."""
    children = {}
    try:
        for side in SIDES:
            log(f"loading {side} ...")
            children[side] = Child(side, model_dir, threads)
            log(f"  {side} loaded in {children[side].hello['load_s']:.1f} s")
        for child in children.values():  # warm-up, not measured
            child.ask(cmd="run", messages=PROMPTS["short"], max_tokens=8)
        runs: dict[str, list[dict]] = {side: [] for side in SIDES}
        for r in range(rounds):
            order = SIDES if r % 2 == 0 else SIDES[::-1]
            for name, messages in PROMPTS.items():
                for side in order:
                    result = children[side].ask(cmd="run", messages=messages, max_tokens=max_tokens)
                    result["prompt"] = name
                    runs[side].append(result)
                    log(
                        f"  round {r + 1} {name:13s} {side:8s} ttft {result['ttft_ms']:7.1f} ms"
                        f"  decode {result['decode_tok_s']:6.2f} tok/s"
                    )
        report = {}
        for side, child in children.items():
            peak = child.ask(cmd="stats")["peak_rss_mb"]
            report[side] = side_report(runs[side], peak, child.hello)
        return report
    finally:
        for child in children.values():
            child.close()


def side_report(runs: list[dict], peak_rss_mb: float, hello: dict) -> dict:
    core = [r for r in runs if r["prompt"] in CORE]
    summary = summarize(core, peak_rss_mb, hello["load_s"])
    follow = [r["ttft_ms"] for r in runs if r["prompt"] == "follow_up"]
    summary["follow_up_ttft_ms_p50"] = round(percentile(follow, 50), 1)
    summary["setup"] = hello["setup"]
    summary["per_prompt"] = {
        name: {
            "prompt_tokens": next(r["prompt_tokens"] for r in runs if r["prompt"] == name),
            "ttft_ms_p50": round(
                percentile([r["ttft_ms"] for r in runs if r["prompt"] == name], 50), 1
            ),
            "decode_tok_s_p50": round(
                percentile([r["decode_tok_s"] for r in runs if r["prompt"] == name], 50), 2
            ),
        }
        for name in PROMPTS
    }
    summary["runs"] = len(runs)
    return summary


def format_table(report: dict) -> str:
    keys = (*SUMMARY_KEYS, "follow_up_ttft_ms_p50")
    sides = [s for s in SIDES if s in report]
    lines = [f"{'':24s}" + "".join(f"{s:>12s}" for s in sides) + f"{'ratio':>10s}"]
    for key in keys:
        values = [report[s].get(key) for s in sides]
        ratio = ""
        if len(values) == 2 and values[1]:
            ratio = f"{values[0] / values[1]:9.2f}x"
        lines.append(f"{key:24s}" + "".join(f"{v:12.2f}" for v in values) + f"{ratio:>10s}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench",
        description="Measure deskchat's engine (as configured by DESKCHAT_* settings) against "
        "plain transformers (fp32 model.generate), alternating them in one run.",
    )
    parser.add_argument(
        "--model",
        default="qwen-shape",
        help="a model folder, 'embedded' (SmolLM2-135M) or 'qwen-shape' "
        "(Qwen2.5-0.5B shape, random weights, built once into the cache)",
    )
    parser.add_argument(
        "--fixture",
        default=None,
        help="Qwen shape fixture folder [env DESKCHAT_QWEN_FIXTURE; default "
        "../shared/fixtures/qwen2.5-0.5b-instruct next to the repo]",
    )
    parser.add_argument("--rounds", type=int, default=3, help="passes over the prompt set")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per answer")
    parser.add_argument("--json", metavar="FILE", help="also write the report as JSON here")
    parser.add_argument(
        "--http", metavar="URL", help="measure a running server instead (POST URL/chat, streamed)"
    )
    parser.add_argument("--clients", type=int, default=1, help="with --http: concurrent clients")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from inference.config import load_config

    config = load_config([], os.environ)
    if args.http:
        from bench.http_client import run_http

        report = run_http(args.http, args.clients, args.rounds, args.max_tokens)
        print(json.dumps(report, indent=2))
    else:
        from bench.qwen_shape import FixtureMissing

        try:
            model_dir = resolve_model(args.model, config.cache_dir, args.fixture)
        except FixtureMissing as exc:
            print(f"bench: {exc}", file=sys.stderr)
            return 2
        print(
            f"model {model_dir}; {args.rounds} rounds x {len(PROMPTS)} prompts x "
            f"{args.max_tokens} tokens; threads {config.threads}"
        )
        load_before = os.getloadavg()
        report = run_side_by_side(model_dir, args.rounds, args.max_tokens, config.threads)
        report["meta"] = {
            # a shared CPU: the 1-minute load average before and after, to read numbers by
            "loadavg_1m": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
            "model": str(model_dir),
            "rounds": args.rounds,
            "max_tokens": args.max_tokens,
            "cpu_capability": os.environ.get("ATEN_CPU_CAPABILITY", "default"),
            "onednn_max_cpu_isa": os.environ.get("ONEDNN_MAX_CPU_ISA", "default"),
            # fbgemm (the int8 kernels) ignores the two above and reads its own variable
            "fbgemm_enable_instructions": os.environ.get("FBGEMM_ENABLE_INSTRUCTIONS", "default"),
        }
        print(format_table(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0
