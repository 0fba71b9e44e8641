"""`--versus-server`: one round against a fake server, the medians and ratios of the table,
the GGUF cache, the VmHWM of a real child (no timing asserts, no big model)."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from bench.peer_llamacpp import PeerMissing
from bench.serving import llama_server, versus
from bench.stats import peak_rss_mb
from tests.support.fakes import FakeEngine
from tests.support.llama_tree import fake_llama_tree


def test_one_round_measures_every_workload_through_the_openai_stream(fake_server, monkeypatch):
    monkeypatch.setattr(versus, "LONG_PROMPT_TOKENS", 300)  # the fake counts characters
    server = fake_server(FakeEngine(token_s=0.001))
    run = versus.measure(server.url, round_no=0)
    assert run["errors"] == []
    samples = run["samples"]
    assert [len(samples[k]) for k in samples] == [1, 1, versus.SHORT_ASKS, versus.LONG_ASKS]
    assert all(v > 0 and math.isfinite(v) for vs in samples.values() for v in vs)
    assert run["answer_tokens"] == [versus.ANSWER_TOKENS] * (1 + versus.USERS)  # usage counted
    short, long = run["prompt_tokens"]["short"], run["prompt_tokens"]["long"]
    assert len(set(long)) == 1 and long[0] > 10 * short[0]  # the fake counts characters


def test_a_failed_request_is_listed_not_measured():
    run = versus.measure("http://127.0.0.1:1", round_no=0)
    assert run["samples"]["decode_tok_s"] == [] and run["samples"]["ttft_long_ms"] == []
    assert len(run["errors"]) == 1 + versus.USERS + versus.SHORT_ASKS + versus.LONG_ASKS


def test_decode_rate_counts_the_tokens_after_the_first():
    assert versus.decode_rate({"tokens": 11, "arrivals": [1.0, 1.5, 3.0]}) == 5.0
    assert math.isnan(versus.decode_rate({"tokens": 1, "arrivals": [1.0]}))


def _run(decode: list[float], ttft: list[float], vmhwm: float) -> dict:
    return {
        "samples": {
            "decode_tok_s": decode,
            "users_tok_s": [2 * d for d in decode],
            "ttft_short_ms": ttft,
            "ttft_long_ms": [10 * t for t in ttft],
            "vmhwm_mb": [vmhwm],
        },
        "errors": [],
    }


def test_medians_pool_the_rounds_and_ratios_are_deskchat_over_llama_server():
    ours = versus.medians([_run([10.0], [100.0, 300.0], 900.0), _run([30.0], [200.0], 1100.0)])
    assert ours == {
        "decode_tok_s": 20.0,
        "users_tok_s": 40.0,
        "ttft_short_ms": 200.0,
        "ttft_long_ms": 2000.0,
        "vmhwm_mb": 1000.0,
    }
    theirs = versus.medians([_run([40.0], [400.0], 500.0)])
    by_side = {"deskchat": ours, "llama-server": theirs}
    ratios = versus.ratios(by_side)
    assert ratios == {
        "decode_tok_s": 0.5,
        "users_tok_s": 0.5,
        "ttft_short_ms": 0.5,
        "ttft_long_ms": 0.5,
        "vmhwm_mb": 2.0,
    }
    meta = {
        "model": "qwen-shape",
        "rounds": 2,
        "loadavg_before": [1.5, 1.0, 0.5],
        "loadavg_after": [2.25, 1.0, 0.5],
        "errors": 0,
    }
    table = versus.format_table({"medians": by_side, "ratios": ratios, "meta": meta})
    rows = [line for line in table.splitlines() if line.startswith("| (")]
    assert len(rows) == len(versus.WORKLOADS)
    assert rows[0] == "| (a) one user's decode, tok/s | 20 | 40 | 0.50x | higher |"
    assert rows[-1].endswith("| 1000 | 500 | 2.00x | lower |")
    assert "before 1.50 1.00 0.50, after 2.25 1.00 0.50" in table


def test_vmhwm_is_the_childs_own_peak_not_ours():
    child = subprocess.Popen(
        [sys.executable, "-c", "b = bytearray(96 << 20); print(flush=True); input()"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        child.stdout.readline()  # allocated (bytearray zero-fills: touched)
        peak = peak_rss_mb(child.pid)
        assert 96 <= peak < 96 + 64  # the interpreter's own few MB on top
        assert peak != peak_rss_mb()
    finally:
        child.communicate("\n")
    assert math.isnan(peak_rss_mb(child.pid))  # gone: NaN, not a stale number


def test_gguf_is_made_with_the_servers_own_tree_once_and_cached(tmp_path):
    server = fake_llama_tree(tmp_path / "llama.cpp")
    model = tmp_path / "qwen-shape-1.5b"
    model.mkdir()
    cache = tmp_path / "cache"
    gguf = llama_server.ensure_gguf(model, cache, server, log=lambda _t: None)
    assert gguf == cache / "qwen-shape-1.5b-gguf-server" / "q4_k_m.gguf"
    assert gguf.read_text() == "q4\n" and (gguf.parent / "bf16.gguf").read_text() == "bf16"
    assert llama_server.ensure_gguf(model, cache, server, log=lambda _t: None) == gguf
    calls = (tmp_path / "llama.cpp" / "calls.log").read_text().splitlines()
    assert len(calls) == 2 and calls[0].startswith(f"convert {model} --outtype bf16")
    assert calls[1].startswith("quantize Q4_K_M ")  # once: the second call found the cache
    argv = llama_server.command(server, gguf)(8123)
    assert argv == [str(server), "-m", str(gguf), "-t", "2", "-np", "4", "-c", "8192"] + [
        "--port",
        "8123",
    ]


@pytest.mark.parametrize("bench", ["--versus-server", "--prefix"])
def test_a_missing_llama_server_says_how_to_get_one(tmp_path, capsys, monkeypatch, bench):
    from bench import cli
    from bench.serving import prefix

    monkeypatch.setattr(prefix, "Server", None)  # --prefix: found before a server starts
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    argv = [bench, "--model", str(model), "--cache-dir", str(tmp_path)]
    assert cli.main([*argv, "--llama-server", str(tmp_path / "nope")]) == 2
    assert "docs/speed.md" in capsys.readouterr().err
    with pytest.raises(PeerMissing, match="llama-quantize"):
        server = tmp_path / "llama-server"
        server.write_text("#!/bin/sh\n")
        server.chmod(0o755)
        llama_server.tools(server)


def test_a_converter_missing_a_module_names_the_install(tmp_path):
    from bench.peer_llamacpp import INSTALL_HINT, convert

    (tmp_path / "convert_hf_to_gguf.py").write_text("import sentencepiece_not_here\n")
    with pytest.raises(PeerMissing, match=INSTALL_HINT.replace(".", r"\.")):
        convert(tmp_path, tmp_path, tmp_path / "out.gguf", "bf16", log=lambda _t: None)
