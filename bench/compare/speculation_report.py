"""The speculation benchmark's numbers from its runs (bench/compare/speculation.py): per kind
and side the median decode tokens/s, acceptance and tokens per step, the paired ratios, the
four-stream totals, the targets speculation must meet, every answer whose greedy text changed with
speculation, and the Markdown that shows them (mismatches first, so none goes unseen)."""

from __future__ import annotations

from bench.speculation_tasks import GROUNDED_KINDS, KINDS
from bench.stats import percentile

SPEC, PLAIN = "deskchat_spec", "deskchat_plain"
LLAMA_PLAIN, LLAMA_LOOKUP = "llamacpp_plain", "llamacpp_lookup"
TITLES = {
    SPEC: "deskchat spec",
    PLAIN: "deskchat no-spec",
    LLAMA_PLAIN: "llama.cpp plain",
    LLAMA_LOOKUP: "llama.cpp lookup",
}
ROWS = (*GROUNDED_KINDS, "grounded", "open")  # "grounded": the four kinds together
TARGETS = (  # what speculation must meet, read off the report
    ("grounded one stream: spec / no-spec", 2.0),
    ("grounded one stream: spec / best llama.cpp", 1.0),
    ("open chat one stream: spec / no-spec", 0.97),
    ("four streams total: spec / no-spec", 1.0),
)


# -- the summary --------------------------------------------------------------------------------


def _ok(runs: list[dict], side: str, kinds) -> list[dict]:
    return [r for r in runs if r["side"] == side and r["kind"] in kinds and "error" not in r]


def _kinds_of(row: str) -> tuple[str, ...]:
    return GROUNDED_KINDS if row == "grounded" else (row,)


def _median(values: list[float]) -> float | None:
    return round(percentile(values, 50), 3) if values else None


def _share(part: list, whole: list) -> float | None:
    if not whole or None in part or None in whole or not sum(whole):
        return None
    return round(sum(part) / sum(whole), 3)


def paired_ratio(runs: list[dict], a: str, b: str, kinds) -> float | None:
    """Median over the same task and round of a's decode tokens/s over b's: the two ran back
    to back, so a load that drifts over the run cancels."""
    by = {(r["task"], r["round"]): r["decode_tok_s"] for r in _ok(runs, b, kinds)}
    ratios = [
        r["decode_tok_s"] / by[key]
        for r in _ok(runs, a, kinds)
        if r["decode_tok_s"] and by.get(key := (r["task"], r["round"]))
    ]
    return _median(ratios)


def side_row(runs: list[dict], side: str, kinds) -> dict:
    mine = _ok(runs, side, kinds)
    return {
        "decode_tok_s_p50": _median([r["decode_tok_s"] for r in mine if r["decode_tok_s"]]),
        "acceptance": _share(
            [r["draft_tokens"] for r in mine], [r["drafted_tokens"] for r in mine]
        ),
        "tokens_per_step": _share([r["tokens"] for r in mine], [r["decode_steps"] for r in mine]),
        "tokens_mean": round(sum(r["tokens"] for r in mine) / len(mine), 1) if mine else None,
        "runs": len(mine),
    }


def summarize_kinds(runs: list[dict], sides: list[str]) -> dict:
    table = {}
    llamas = [s for s in (LLAMA_PLAIN, LLAMA_LOOKUP) if s in sides]
    for row in ROWS:
        kinds = _kinds_of(row)
        if not any(r["kind"] in kinds for r in runs):
            continue
        entry = {side: side_row(runs, side, kinds) for side in sides}
        best = max(
            llamas, key=lambda s: entry[s]["decode_tok_s_p50"] or 0, default=None
        )  # the faster llama.cpp side on this row
        entry["ratios"] = {
            "spec_over_plain": paired_ratio(runs, SPEC, PLAIN, kinds),
            "spec_over_best_llamacpp": paired_ratio(runs, SPEC, best, kinds) if best else None,
            "best_llamacpp": best,
        }
        table[row] = entry
    return table


def summarize_four(per_round: list[dict]) -> dict:
    """Per deskchat side its total tokens/s per round and their median; spec / no-spec is the
    median over rounds of the two sides' ratio (they ran one after the other)."""
    out = {}
    for side in (SPEC, PLAIN):
        mine = [r for r in per_round if r["side"] == side]
        out[side] = {
            "total_tok_s_p50": _median([r["total_tok_s"] for r in mine]),
            "rounds": [r["total_tok_s"] for r in mine],
            "errors": sum(r["errors"] for r in mine),
        }
    pairs = {r["round"]: r["total_tok_s"] for r in per_round if r["side"] == PLAIN}
    ratios = [
        r["total_tok_s"] / pairs[r["round"]]
        for r in per_round
        if r["side"] == SPEC and pairs.get(r["round"])
    ]
    out["spec_over_plain"] = _median(ratios)
    return out


def mismatches(runs: list[dict], per_round: list[dict]) -> list[dict]:
    """Every deskchat answer whose text is not the no-speculation one-stream answer of its
    first round (the reference): with or without speculation, one stream or four."""
    reference = {
        r["task"]: r["text"] for r in reversed(runs) if r["side"] == PLAIN and "error" not in r
    }
    found = []
    answers = [
        (f"one stream, round {r['round']}", r["side"], r["task"], r["text"])
        for r in runs
        if r["side"] in (SPEC, PLAIN) and "error" not in r
    ]
    answers += [
        (f"four streams, round {row['round']}", row["side"], task, text)
        for row in per_round
        for task, text in row["texts"]
    ]
    for where, side, task, text in answers:
        want = reference.get(task)
        if want is not None and text != want:
            at = next(
                (i for i, (a, b) in enumerate(zip(want, text, strict=False)) if a != b),
                min(len(want), len(text)),
            )
            found.append(
                {
                    "where": where,
                    "side": side,
                    "task": task,
                    "first_difference": at,
                    "no_spec": want[max(0, at - 40) : at + 80],
                    "this": text[max(0, at - 40) : at + 80],
                }
            )
    return found


def llama_agreement(runs: list[dict]) -> dict | None:
    """How many tasks llama.cpp answered the same with and without its prompt lookup (its
    multi-token passes may round differently: information, not a failure)."""
    plain = {(r["task"], r["round"]): r["text"] for r in _ok(runs, LLAMA_PLAIN, KINDS)}
    lookup = {(r["task"], r["round"]): r["text"] for r in _ok(runs, LLAMA_LOOKUP, KINDS)}
    shared = plain.keys() & lookup.keys()
    if not shared:
        return None
    return {"same": sum(plain[k] == lookup[k] for k in shared), "of": len(shared)}


def targets(kinds: dict, four: dict | None) -> list[dict]:
    values = [
        kinds.get("grounded", {}).get("ratios", {}).get("spec_over_plain"),
        kinds.get("grounded", {}).get("ratios", {}).get("spec_over_best_llamacpp"),
        kinds.get("open", {}).get("ratios", {}).get("spec_over_plain"),
        (four or {}).get("spec_over_plain"),
    ]
    return [
        {"what": what, "target": goal, "value": v, "met": None if v is None else v >= goal}
        for (what, goal), v in zip(TARGETS, values, strict=True)
    ]


def build_report(
    meta: dict, sides: list[str], runs: list[dict], per_round: list[dict], ids: dict
) -> dict:
    """The whole report: the summaries, then the raw runs (texts included)."""
    kinds = summarize_kinds(runs, sides)
    four = summarize_four(per_round) if per_round else None
    errors = [r for r in runs if "error" in r]
    errors += [
        {"side": r["side"], "round": r["round"], "error": f"{r['errors']} failed at once"}
        for r in per_round
        if r["errors"]
    ]
    return {
        "meta": meta,
        "sides_measured": sides,
        "kinds": kinds,
        "four_streams": four,
        "targets": targets(kinds, four),
        "mismatches": mismatches(runs, per_round),
        "llamacpp_same_text": llama_agreement(runs),
        # deskchat's prompt token count against the ids llama.cpp was given
        "prompt_tokens_differ": sorted(
            {
                r["task"]
                for r in runs
                if "error" not in r and r["prompt_tokens"] != len(ids[r["task"]])
            }
        ),
        "errors": errors,
        "runs": runs,
        "four_stream_rounds": per_round,
    }


# -- the report ---------------------------------------------------------------------------------


def _num(value, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def format_report(report: dict) -> str:
    """Markdown, to paste into docs: mismatches first, then the tables and the run."""
    sides = report["sides_measured"]
    lines = ["## Speculation benchmark", ""]
    bad = report["mismatches"]
    if bad:
        lines += [
            f"**!! {len(bad)} deskchat answers differ from the greedy answer without "
            "speculation (an engine bug):**",
            "",
        ]
        for m in bad:
            lines.append(
                f"- {m['task']} ({m['side']}, {m['where']}), from character "
                f"{m['first_difference']}: no-spec {m['no_spec']!r} vs this {m['this']!r}"
            )
        lines.append("")
    else:
        lines += ["Greedy text with and without speculation: identical for every answer.", ""]
    if report["errors"]:
        lines += [f"**!! {len(report['errors'])} failed requests** (the JSON lists them)", ""]
    if report["prompt_tokens_differ"]:
        lines += [
            "**!! deskchat counted other prompt tokens than llama.cpp was given for:** "
            + ", ".join(report["prompt_tokens_differ"]),
            "",
        ]
    if report["meta"].get("llamacpp_skipped"):
        lines += [f"llama.cpp sides skipped: {report['meta']['llamacpp_skipped']}", ""]
    if not report["meta"]["speculate_flag"]:
        lines += [
            "**The server here has no --speculate: both deskchat sides ran the same engine.**",
            "",
        ]
    titles = [TITLES[s] for s in sides]
    lines += [
        "One stream, decode tokens/s (median of prompts x rounds); ratios are medians over "
        "pairs of runs of the same prompt in the same round.",
        "",
        "| kind | runs | " + " | ".join(titles) + " | spec / no-spec | spec / best llama.cpp |",
        "|---|---|" + "---|" * (len(sides) + 2),
    ]
    for row, entry in report["kinds"].items():
        ratios = entry["ratios"]
        cells = [_num(entry[s]["decode_tok_s_p50"]) for s in sides]
        lines.append(
            f"| {row} | {entry[sides[0]]['runs']} | "
            + " | ".join(cells)
            + f" | {_num(ratios['spec_over_plain'])} | {_num(ratios['spec_over_best_llamacpp'])} |"
        )
    lines += [
        "",
        "Acceptance (answer tokens from accepted drafts / drafted tokens) · tokens per step "
        "(answer tokens / forward passes) · mean answer tokens",
        "",
        "| kind | " + " | ".join(titles) + " |",
        "|---|" + "---|" * len(sides),
    ]
    for row, entry in report["kinds"].items():
        cells = [
            f"{_num(entry[s]['acceptance'])} · {_num(entry[s]['tokens_per_step'])} · "
            f"{_num(entry[s]['tokens_mean'], 0)}"
            for s in sides
        ]
        lines.append(f"| {row} | " + " | ".join(cells) + " |")
    four = report.get("four_streams")
    if four:
        meta = report["meta"]
        lines += [
            "",
            f"{meta['streams']} streams at once (grounded prompts), total tokens/s per round:",
            "",
            "| side | rounds | median | errors |",
            "|---|---|---|---|",
        ]
        for side in (SPEC, PLAIN):
            s = four[side]
            rounds = ", ".join(f"{v:.2f}" for v in s["rounds"])
            lines.append(
                f"| {TITLES[side]} | {rounds} | {_num(s['total_tok_s_p50'])} | {s['errors']} |"
            )
        lines += ["", f"spec / no-spec (median of rounds): {_num(four['spec_over_plain'])}"]
    lines += ["", "Targets:", ""]
    for t in report["targets"]:
        verdict = {True: "met", False: "NOT met", None: "not measured"}[t["met"]]
        lines.append(f"- {t['what']}: {_num(t['value'])} (target >= {t['target']}): {verdict}")
    agree = report.get("llamacpp_same_text")
    if agree:
        lines += [
            "",
            f"llama.cpp plain and lookup gave the same text on {agree['same']} of "
            f"{agree['of']} answers (its passes of several tokens may round otherwise).",
        ]
    m = report["meta"]
    lines += [
        "",
        f"Run: {m['started']}, commit {m['commit']}; {m['cpu_model']}, {m['cpus']} CPUs, "
        f"{m['threads']} inference threads (torch and llama.cpp); load average (1, 5, 15 min) "
        f"{m['loadavg_start']} at the start, {m['loadavg_end']} at the end; {m['rounds']} "
        f"rounds, max_tokens {m['max_tokens']}, {m['tasks']} prompts; "
        f"`{m['command']}`",
    ]
    return "\n".join(lines)
