"""`python -m bench`'s default: the engine against plain transformers (and llama.cpp with
--peer), each side in its own child process (bench/compare/child.py), requests alternating between
them; the per-side summary and the table."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from bench.models import resolve_model
from bench.prompts import CORE, PROMPTS
from bench.stats import SUMMARY_KEYS, percentile, summarize

SIDES = ("engine", "baseline")


class Child:
    """A bench/compare/child.py process speaking JSON lines."""

    def __init__(self, side: str, model_dir: Path, threads: int, extra: tuple[str, ...] = ()):
        self.side = side
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "bench.compare.child",
                "--side",
                side,
                "--model-dir",
                str(model_dir),
                "--threads",
                str(threads),
                *extra,
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=Path(__file__).resolve().parents[2],  # the repo
        )
        try:
            self.hello = self._read()
        except BaseException:
            self.proc.kill()
            self.proc.wait()
            raise

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
        """End the child; one that does not leave within 30 s is killed."""
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def prompt_ids(model_dir: Path, prompts: dict[str, list[dict]] = PROMPTS) -> dict[str, list[int]]:
    """The prompts as token ids, rendered with the model's chat template as the server
    renders them (for peer sides, which are given ids)."""
    from transformers import AutoTokenizer

    from inference.runtime.prompt import PromptBuilder

    builder = PromptBuilder(AutoTokenizer.from_pretrained(model_dir), context_tokens=0)
    return {name: builder.encode(messages) for name, messages in prompts.items()}


def run_side_by_side(
    model_dir: Path,
    rounds: int,
    max_tokens: int,
    threads: int,
    log=print,
    peers: dict[str, Path] | None = None,
) -> dict:
    """Load each side in turn (alone on the CPU), then alternate them request by request.

    `peers` maps extra side names (llamacpp_q8_0, ...) to their GGUF files; those sides get
    the prompts as token ids rendered here with the model's chat template.
    """
    peers = peers or {}
    sides = (*SIDES, *peers)
    ids = prompt_ids(model_dir) if peers else {}

    def ask_run(side: str, name: str, tokens: int) -> dict:
        if side in peers:
            return children[side].ask(cmd="run", ids=ids[name], max_tokens=tokens)
        return children[side].ask(cmd="run", messages=PROMPTS[name], max_tokens=tokens)

    children = {}
    try:
        for side in sides:
            log(f"loading {side} ...")
            extra = ("--gguf", str(peers[side])) if side in peers else ()
            children[side] = Child(side, model_dir, threads, extra)
            log(f"  {side} loaded in {children[side].hello['load_s']:.1f} s")
        for side in sides:  # warm-up, not measured
            ask_run(side, "short", 8)
        runs: dict[str, list[dict]] = {side: [] for side in sides}
        for r in range(rounds):
            order = sides if r % 2 == 0 else sides[::-1]
            for name in PROMPTS:
                for side in order:
                    result = ask_run(side, name, max_tokens)
                    result["prompt"] = name
                    runs[side].append(result)
                    log(
                        f"  round {r + 1} {name:13s} {side:15s} ttft {result['ttft_ms']:7.1f} ms"
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
    sides = [s for s in report if s != "meta"]
    width = max(12, *(len(s) + 2 for s in sides))
    lines = [f"{'':24s}" + "".join(f"{s:>{width}s}" for s in sides) + f"{'ratio':>10s}"]
    for key in keys:
        values = [report[s].get(key) for s in sides]
        ratio = ""  # engine / baseline
        engine, baseline = (report.get(s, {}).get(key) for s in SIDES)
        if engine is not None and baseline:
            ratio = f"{engine / baseline:9.2f}x"
        lines.append(f"{key:24s}" + "".join(f"{v:{width}.2f}" for v in values) + f"{ratio:>10s}")
    return "\n".join(lines)


def run(args, config) -> dict:
    """`python -m bench` without --http or --batch-curve: the report, its table printed.
    Raises FixtureMissing or PeerMissing when the model or the peer cannot be had."""
    model_dir = resolve_model(args.model, config.cache_dir, args.fixture)
    print(
        f"model {model_dir}; {args.rounds} rounds x {len(PROMPTS)} prompts x "
        f"{args.max_tokens} tokens; threads {config.threads}"
    )
    load_before = os.getloadavg()
    peers = {}
    if args.peer:
        from bench.peer_llamacpp import ensure_ggufs

        peers = ensure_ggufs(model_dir, config.cache_dir, config.threads)
    report = run_side_by_side(model_dir, args.rounds, args.max_tokens, config.threads, peers=peers)
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
    return report
