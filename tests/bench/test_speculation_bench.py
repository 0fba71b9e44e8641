"""bench/compare/speculation.py and its task set: what the task set promises issue 25, what the
report computes and shows (a changed greedy text above all), and one real run end to end."""

from __future__ import annotations

import json
import sys
from argparse import Namespace

import numpy as np
import pytest

from bench.compare import speculation
from bench.compare.speculation_report import (
    LLAMA_LOOKUP,
    LLAMA_PLAIN,
    PLAIN,
    SPEC,
    build_report,
    format_report,
)
from bench.speculation_tasks import GROUNDED_KINDS, TASKS
from tests.support.fakes import FakeEngine
from tests.support.paths import TEST_CACHE


def test_task_set_has_what_issue_25_asks_for():
    assert len({t.name for t in TASKS}) == len(TASKS)
    grounded = [t for t in TASKS if t.kind in GROUNDED_KINDS]
    assert len(grounded) >= 24
    for kind in GROUNDED_KINDS:
        assert sum(t.kind == kind for t in TASKS) >= 6, kind
    for task in grounded:
        assert 60 <= len(task.given.split()) <= 200, task.name
        assert task.given in task.messages[0]["content"]
    assert sum(t.kind == "open" for t in TASKS) >= 8
    assert all(t.messages[0]["role"] == "user" and len(t.messages) == 1 for t in TASKS)


def test_tasks_are_picked_by_name_or_kind():
    picked = speculation.pick_tasks("code,open-haiku")
    assert {t.kind for t in picked} == {"code", "open"} and len(picked) == 7
    with pytest.raises(SystemExit, match="nonsense"):
        speculation.pick_tasks("nonsense")


def _run(side, task, kind, rnd, rate, text="same", tokens=100, drafts=(None, None, None)):
    accepted, drafted, steps = drafts
    return {
        "side": side,
        "task": task,
        "kind": kind,
        "round": rnd,
        "prompt_tokens": 50,
        "tokens": tokens,
        "ttft_ms": 100.0,
        "decode_tok_s": rate,
        "draft_tokens": accepted,
        "drafted_tokens": drafted,
        "decode_steps": steps,
        "finish": "length",
        "text": text,
    }


def _report(runs, per_round=()):
    meta = {
        "speculate_flag": True,
        "streams": 4,
        "started": "now",
        "commit": "abc",
        "cpu_model": "cpu",
        "cpus": 2,
        "threads": 2,
        "loadavg_start": [0.1, 0.1, 0.1],
        "loadavg_end": [1.0, 0.5, 0.2],
        "rounds": 1,
        "max_tokens": 100,
        "tasks": 2,
        "command": "python -m bench.compare.speculation",
    }
    sides = list(dict.fromkeys(r["side"] for r in runs))
    ids = {r["task"]: [0] * r["prompt_tokens"] for r in runs}  # as many as the server counted
    return build_report(meta, sides, runs, list(per_round), ids)


def test_report_gives_medians_paired_ratios_drafts_and_targets():
    runs = [
        _run(SPEC, "s", "summarize", 1, 60.0, drafts=(80, 100, 25)),
        _run(PLAIN, "s", "summarize", 1, 20.0, drafts=(None, None, None)),
        _run(LLAMA_PLAIN, "s", "summarize", 1, 30.0, drafts=(0, 0, 100)),
        _run(LLAMA_LOOKUP, "s", "summarize", 1, 40.0, drafts=(50, 200, 50)),
        _run(SPEC, "o", "open", 1, 19.0),
        _run(PLAIN, "o", "open", 1, 20.0),
        _run(LLAMA_PLAIN, "o", "open", 1, 30.0),
        _run(LLAMA_LOOKUP, "o", "open", 1, 25.0),
    ]
    four = [
        {"side": SPEC, "round": 1, "errors": 0, "total_tok_s": 50.0, "texts": [["s", "same"]]},
        {"side": PLAIN, "round": 1, "errors": 0, "total_tok_s": 40.0, "texts": [["s", "same"]]},
    ]
    report = _report(runs, four)
    grounded = report["kinds"]["grounded"]
    assert grounded[SPEC]["decode_tok_s_p50"] == 60.0
    assert grounded[SPEC]["acceptance"] == 0.8 and grounded[SPEC]["tokens_per_step"] == 4.0
    assert grounded[PLAIN]["acceptance"] is None  # not reported: unknown, not zero
    assert grounded[LLAMA_PLAIN]["tokens_per_step"] == 1.0
    assert grounded["ratios"] == {
        "spec_over_plain": 3.0,
        "spec_over_best_llamacpp": 1.5,
        "best_llamacpp": LLAMA_LOOKUP,
    }
    assert report["kinds"]["open"]["ratios"]["best_llamacpp"] == LLAMA_PLAIN
    assert report["four_streams"]["spec_over_plain"] == 1.25
    assert [t["met"] for t in report["targets"]] == [True, True, False, True]
    assert report["mismatches"] == [] and report["errors"] == []
    assert report["llamacpp_same_text"] == {"same": 2, "of": 2}
    json.dumps(report)
    table = format_report(report)
    assert "identical for every answer" in table
    assert "| grounded | 1 | 60.00 | 20.00 | 30.00 | 40.00 | 3.00 | 1.50 |" in table
    assert "0.80 · 4.00 · 100" in table and "NOT met" in table


def test_a_changed_greedy_text_heads_the_report():
    runs = [
        _run(PLAIN, "s", "summarize", 1, 20.0, text="The printer is broken."),
        _run(SPEC, "s", "summarize", 1, 60.0, text="The printer is fixed."),
        _run(PLAIN, "s", "summarize", 2, 20.0, text="The printer is broken."),
    ]
    four = [{"side": SPEC, "round": 1, "errors": 0, "total_tok_s": 5.0, "texts": [["s", "x"]]}]
    report = _report(runs, four)
    assert [(m["side"], m["where"]) for m in report["mismatches"]] == [
        (SPEC, "one stream, round 1"),
        (SPEC, "four streams, round 1"),
    ]
    assert report["mismatches"][0]["first_difference"] == len("The printer is ")
    head = format_report(report).splitlines()[2]
    assert head.startswith("**!! 2 deskchat answers differ")


def test_missing_llama_cpp_skips_its_sides_with_the_install_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import fails as if not installed
    said = []
    sides, why = speculation.llama_sides(Namespace(peer="llamacpp"), 2, said.append)
    assert sides == {} and "pip install -r requirements-peer.txt" in why
    assert said and "skipped" in said[0]


class _ScriptedLlama:
    """Llama.generate's loop as llama-cpp-python 0.3.36 runs it with a draft model (eval the
    last token and the drafts, sample at each fed position, cut the cache at the first
    disagreement), over a model whose greedy answer is `answer`."""

    def __init__(self, answer: list[int], drafts: list[list[int]]):
        self.answer, self.drafts = answer, iter(drafts)
        self.input_ids = np.zeros(64, dtype=np.intc)
        self.n_tokens = 0

    def eval(self, tokens):
        self.input_ids[self.n_tokens : self.n_tokens + len(tokens)] = tokens
        self.n_tokens += len(tokens)

    def generate(self, tokens, **_sampling):
        prompt, tokens = len(tokens), list(tokens)
        sample_idx = self.n_tokens + len(tokens) - 1
        while True:
            self.eval(tokens)
            while sample_idx < self.n_tokens:
                token = self.answer[sample_idx + 1 - prompt]  # the greedy pick
                sample_idx += 1
                yield token
                tokens = [token]
                if sample_idx < self.n_tokens and token != self.input_ids[sample_idx]:
                    self.n_tokens = sample_idx
                    break
            tokens += next(self.drafts)


def test_llama_cpp_passes_and_accepted_drafts_are_counted_from_generate():
    answer = [10, 11, 12, 13, 14, 15, 16, 2]
    # after 10: drafts 11 12 99 (two accepted, 13 corrects 99); after 13: none; after 14:
    # 15 16 2 7 (15 and 16 accepted; 2, the end, matches too but ends the answer, and the
    # engine does not count an answer's last token as a draft's)
    llm = _ScriptedLlama(answer, [[11, 12, 99], [], [15, 16, 2, 7]])
    out, accepted, feeds, first, last = speculation.counted_generate(llm, [1, 1, 1], 20, {2})
    assert out == answer and accepted == 2 + 2
    assert feeds == [3, 1 + 3, 1, 1 + 4] and first <= last
    assert "eval" not in vars(llm)  # the counting wrapper is gone
    llm = _ScriptedLlama(answer, [[11, 12, 99], [], [15, 16, 2, 7]])
    out, accepted, feeds, *_ = speculation.counted_generate(llm, [1, 1, 1], 3, {2})
    assert out == [10, 11, 12] and accepted == 1 and feeds == [3, 4]


class _At:
    def __init__(self, url: str):
        self.url = url


def test_deskchat_passes_against_a_scripted_server(fake_server):
    """The one-stream pass alternates the sides and reads their answers; the four-stream pass
    sends every grounded task once per client, all clients at once."""
    tasks = speculation.pick_tasks("summarize-ticket,extract-vpn,open-haiku")
    sides = {
        name: speculation.DeskchatSide(name, _At(fake_server(FakeEngine(token_s=0.001)).url))
        for name in (SPEC, PLAIN)
    }
    ids = {t.name: [] for t in tasks}
    runs = speculation.one_stream(sides, tasks, ids, 2, 5, lambda _t: None)
    assert [r["side"] for r in runs[:4]] == [SPEC, PLAIN, PLAIN, SPEC]
    assert all(r["tokens"] == 5 and r["text"] == "w1 w2 w3 w4 w5 " for r in runs)
    assert all(r["decode_tok_s"] > 0 for r in runs)
    per_round = speculation.four_streams(sides, tasks, 2, 5, 3, lambda _t: None)
    assert [r["side"] for r in per_round] == [SPEC, PLAIN, PLAIN, SPEC]
    assert all(r["requests"] == 3 * 2 and r["errors"] == 0 for r in per_round)
    assert _report(runs, per_round)["mismatches"] == []


@pytest.mark.slow
def test_speculation_bench_end_to_end(embedded_dir, monkeypatch, tmp_path, capsys):
    """Two real servers (with and without --speculate, once the engine takes it) on two
    prompts: the report has its parts, and greedy texts match."""
    monkeypatch.setenv("DESKCHAT_CACHE_DIR", str(TEST_CACHE))  # where embedded_dir converted
    out = tmp_path / "speculation.json"
    argv = ["--tasks", "summarize-ticket,open-haiku", "--rounds", "1", "--max-tokens", "8"]
    assert speculation.main([*argv, "--streams", "2", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["sides_measured"] == [SPEC, PLAIN]
    assert set(report["kinds"]) == {"summarize", "grounded", "open"}
    assert len(report["runs"]) == 2 * 2 and report["errors"] == []
    assert all(1 <= r["tokens"] <= 8 for r in report["runs"])
    assert report["mismatches"] == [] and report["prompt_tokens_differ"] == []
    assert [r["requests"] for r in report["four_stream_rounds"]] == [2, 2]
    assert len(report["meta"]["loadavg_start"]) == 3 and report["meta"]["threads"] >= 1
    assert "## Speculation benchmark" in capsys.readouterr().out
