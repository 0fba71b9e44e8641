"""The bench's own pieces: percentiles, the summary keys the JSON promises, the table."""

from __future__ import annotations

import json
import math

import pytest
import torch

from bench.cli import build_parser
from bench.compare.side_by_side import format_table, side_report
from bench.qwen_shape import FixtureMissing, qwen_shape_dir
from bench.stats import SUMMARY_KEYS, percentile


@pytest.mark.parametrize(
    ("values", "q", "want"),
    [([5.0], 50, 5.0), ([1, 2, 3, 4], 50, 2.5), ([1, 2, 3, 4, 5], 90, 4.6), ([3, 1, 2], 0, 1)],
)
def test_percentile_interpolates_like_numpy(values, q, want):
    assert percentile(values, q) == pytest.approx(want)


def test_percentile_of_nothing_is_nan():
    assert math.isnan(percentile([], 50))


def _runs():
    return [
        {"prompt": p, "prompt_tokens": 10, "ttft_ms": t, "decode_tok_s": d, "e2e_s": e}
        for p, t, d, e in [
            ("short", 100.0, 20.0, 3.0),
            ("chinese_code", 200.0, 22.0, 3.1),
            ("multi_turn", 300.0, 24.0, 3.2),
            ("follow_up", 50.0, 24.0, 2.9),
        ]
    ]


def test_side_report_has_the_promised_keys_and_excludes_follow_up_from_ttft():
    report = side_report(_runs(), peak_rss_mb=1000.0, hello={"load_s": 2.0, "setup": {}})
    assert set(SUMMARY_KEYS) <= set(report)
    assert report["ttft_ms_p50"] == 200.0
    assert report["follow_up_ttft_ms_p50"] == 50.0
    assert report["decode_tok_s_p50"] == 22.0
    json.dumps(report)  # serializable as is


def test_table_shows_ratios_engine_over_baseline():
    hello = {"load_s": 1.0, "setup": {}}
    engine = side_report(_runs(), 500.0, hello)
    baseline = side_report(_runs(), 1000.0, hello)
    table = format_table({"engine": engine, "baseline": baseline})
    assert "peak_rss_mb" in table
    assert "0.50x" in table


def test_missing_fixture_is_a_clear_error(tmp_path):
    with pytest.raises(FixtureMissing, match="--fixture"):
        qwen_shape_dir(tmp_path / "cache", tmp_path / "nowhere")


def test_parser_defaults_to_the_qwen_shape():
    args = build_parser().parse_args([])
    assert args.model == "qwen-shape" and args.clients == 1


def test_parser_accepts_the_llamacpp_peer_only():
    assert build_parser().parse_args(["--peer", "llamacpp"]).peer == "llamacpp"
    assert build_parser().parse_args([]).peer is None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--peer", "vllm"])


def test_missing_llama_cpp_is_a_clear_error(monkeypatch):
    import sys

    from bench.peer_llamacpp import PeerMissing, require_llama_cpp

    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import fails as if not installed
    with pytest.raises(PeerMissing, match=r"pip install -r requirements-peer\.txt"):
        require_llama_cpp()


def test_bench_without_llama_cpp_exits_with_the_install_hint(monkeypatch, tmp_path, capsys):
    import sys

    from bench import cli
    from bench.compare import side_by_side

    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    monkeypatch.setattr(side_by_side, "resolve_model", lambda *_a: tmp_path)
    assert cli.main(["--model", str(tmp_path), "--peer", "llamacpp"]) == 2
    assert "pip install -r requirements-peer.txt" in capsys.readouterr().err


def test_table_has_a_column_per_peer_and_keeps_the_engine_baseline_ratio():
    hello = {"load_s": 1.0, "setup": {}}
    report = {
        "engine": side_report(_runs(), 500.0, hello),
        "baseline": side_report(_runs(), 1000.0, hello),
        "llamacpp_q8_0": side_report(_runs(), 700.0, hello),
        "llamacpp_q4_k_m": side_report(_runs(), 600.0, hello),
        "meta": {"rounds": 1},
    }
    table = format_table(report)
    header = table.splitlines()[0]
    assert "llamacpp_q8_0" in header and "llamacpp_q4_k_m" in header and "meta" not in header
    assert "0.50x" in table


@pytest.mark.slow
def test_step_jitter_reports_the_engines_own_step_times(embedded_dir, capsys, keep_threads):
    from bench.engine import step_jitter

    args = ["--model", str(embedded_dir), "--threads", "1", "--answers", "2", "--max-tokens", "6"]
    assert step_jitter.main(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["threads"] == 1 and report["steps"] == 2 * 5  # the prefill step left out
    for side in ("wall_ms", "cpu_ms"):
        times = report[side]
        assert 0 < times["p50"] <= times["p90"] <= times["p99"] <= times["max"]
    assert step_jitter.main([*args, "--prefill"]) == 0
    prefill = json.loads(capsys.readouterr().out)
    assert prefill["steps"] == 2 and prefill["timed"] == "prefill"  # the first step alone
    assert prefill["wall_ms"]["p50"] > report["wall_ms"]["p50"]  # a prompt's step is longer


@pytest.mark.slow
def test_step_profile_splits_each_batchs_step_into_categories(embedded_dir, capsys, keep_threads):
    from bench.engine import step_profile

    args = ["--model", str(embedded_dir), "--threads", "1", "--batch", "1,3", "--steps", "3"]
    assert step_profile.main(args) == 0
    reports = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["batch"] for r in reports] == [1, 3]
    for r in reports:
        split = r["split_ms"]
        assert r["steps"] == 3 and r["step_ms_plain_p50"] > 0
        assert abs(sum(split.values()) - r["step_ms_profiled"]) < 0.05
        assert 0 < len(r["top_ops"]) <= 12
    if reports[0]["decode_step"].startswith("native"):
        # the whole forward is one C call, whatever the batch, and costs something
        calls = {r["batch"]: op_calls(r, "deskchat::native_step") for r in reports}
        assert calls == {1: 1, 3: 1} and all(r["split_ms"]["native step"] > 0 for r in reports)
    else:
        # the torch step serves int8-row: its GEMMs are fbgemm's, and they cost something
        assert all(r["split_ms"]["int8 GEMM"] > 0 and "attention" in r["split_ms"] for r in reports)
        calls = {r["batch"]: op_calls(r, "quantized::") for r in reports}
        assert calls[1] == calls[3]  # one GEMM per Linear per step, whatever the batch


def op_calls(report: dict, prefix: str) -> float:
    return next(op["calls"] for op in report["top_ops"] if op["op"].startswith(prefix))


def test_step_profile_categories():
    from bench.engine.step_profile import category

    assert category("quantized::linear_with_input_q_dq_qweight_dq_output_fp32") == "int8 GEMM"
    assert category("aten::scaled_dot_product_attention") == "attention"
    assert category("aten::copy_") == "copies and layout"
    assert category("aten::rsqrt") == "elementwise and norms"
    assert category("prim::Something") == "other"
    assert category("aten::div_") == "elementwise and norms"  # the row scaling uses it too


def test_int8_kernels_times_each_candidate_and_checks_the_bits(capsys, monkeypatch, keep_threads):
    from bench.engine import int8_kernels
    from inference.quant import rowint8

    if not rowint8.available():
        pytest.skip("no per-row int8 Linear on this CPU (docs/old-cpus.md)")
    monkeypatch.setattr(int8_kernels, "SHAPES", {"small": (64, 32)})
    assert int8_kernels.main(["--threads", "1", "--rows", "1,3", "--calls", "2"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert {(r["rows"], r["kernel"]) for r in rows} >= {
        (1, int8_kernels.SERVED),
        (3, "_int_mm, transposed view"),
    }
    # Without VNNI the served rows are 7-bit (rowint8.row_limit) and oneDNN's product is not
    # exact there (measured on an AVX2 EPYC: `same` false): the bench reports it, it is not
    # promised. The int8 matmuls sum exactly on every CPU.
    promised = rowint8.row_limit() == 127
    for r in rows:
        assert r["us"] > 0
        if r["kernel"] in int8_kernels.NOT_COMPARED:
            assert r["same"] is None, r
        elif r["kernel"].startswith("oneDNN") and not promised:
            continue  # measured and printed, not promised on this CPU
        else:
            assert r["same"] is True, r  # every exact integer kernel gives the served bits


def test_quality_distance_is_mean_kl_and_top1_over_all_but_each_chunks_last_position():
    from bench.quality import distance

    want = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.8, 0.1], [0.3, 0.3, 0.4]]).log()
    same = distance([want], [want.clone()])
    assert same == {"mean_kl": 0.0, "top1": 1.0, "positions": 2}
    got = torch.tensor([[0.2, 0.7, 0.1], [0.1, 0.8, 0.1], [0.9, 0.05, 0.05]]).log()
    far = distance([want], [got])
    kl_first = float((want[0].exp() * (want[0] - got[0])).sum())
    assert far["positions"] == 2 and far["top1"] == 0.5
    assert math.isclose(far["mean_kl"], kl_first / 2, rel_tol=1e-5)


def test_quality_text_set_is_over_3000_tokens_in_chunks_of_at_most_chunk(embedded_dir):
    from transformers import AutoTokenizer

    from bench.quality import CHUNK, text_chunks

    chunks = text_chunks(AutoTokenizer.from_pretrained(embedded_dir))
    assert all(2 <= len(c) <= CHUNK for c in chunks) and sum(map(len, chunks)) > 3000


@pytest.mark.slow
def test_the_default_bench_runs_both_sides_and_prints_the_table(embedded_dir, tmp_path, capsys):
    """`python -m bench` end to end on the small model (its table once died with an
    UnboundLocalError that only this path reached)."""
    from bench import cli

    out = tmp_path / "report.json"
    argv = ["--model", str(embedded_dir), "--rounds", "1", "--max-tokens", "2", "--json", str(out)]
    assert cli.main(argv) == 0
    report = json.loads(out.read_text())
    assert {"engine", "baseline", "meta"} <= set(report)
    assert report["engine"]["peak_rss_mb"] > 0 and report["baseline"]["decode_tok_s_p50"] > 0
    assert "ratio" in capsys.readouterr().out


@pytest.mark.slow
def test_gemm_floor_times_exactly_the_int8_products_of_a_decode_step(
    embedded_dir, monkeypatch, keep_threads
):
    """bench.engine.gemm_floor's GEMMs-alone figure: the same packed weights a one-row forward
    multiplies by, as many calls, each on a row of that weight's input width."""
    from bench.engine.gemm_floor import step_products
    from bench.engine.step_jitter import engine_and_prompt
    from inference.model.decoder import Segment
    from inference.quant import rowint8

    engine, ids, _threads = engine_and_prompt(str(embedded_dir), 1)
    decoder = engine.decoder
    used = []
    product = rowint8.integer_product
    monkeypatch.setattr(
        rowint8,
        "integer_product",
        lambda x, packed, limit: used.append(packed) or product(x, packed, limit),
    )
    cache = decoder.new_cache(len(ids) + 1)
    decoder.forward([Segment(cache, ids)])
    used.clear()
    decoder.forward([Segment(cache, [ids[0]], decoding=True)])  # one decode step
    products = step_products(decoder)
    assert [id(p) for p, _row, _limit in products] == [id(p) for p in used]
    for packed, row, limit in products:
        in_features = packed.unpack()[0].shape[1]
        assert row.shape == (1, in_features) and row.abs().max() <= limit


def test_read_bandwidth_reports_each_thread_count_and_gives_the_count_back(capsys):
    import torch

    from bench.engine import read_bandwidth

    threads = torch.get_num_threads()
    assert read_bandwidth.main(["--gib", "0.125", "--threads", "1,2", "--repeats", "3"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    rates = [line for line in lines if "threads" in line]
    assert [r["threads"] for r in rates] == [1, 2]
    assert all(0 < r["median_gb_s"] <= r["best_gb_s"] for r in rates)
    assert torch.get_num_threads() == threads
