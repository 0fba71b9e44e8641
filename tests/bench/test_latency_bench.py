"""bench/serving/latency.py and noise.py: what they record, start and stop (no timing asserts)."""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import threading
import time
from pathlib import Path

import pytest

from bench import first_token, launcher, stats
from bench.engine import machine_floor
from bench.serving import latency, noise
from inference.host.process import name_this_thread
from service.config import physical_cores
from tests.support.fakes import FakeEngine
from tests.support.tasks import slice_ns, slices_settable


def test_stream_once_records_ttft_and_every_gap(fake_server) -> None:
    server = fake_server(FakeEngine(token_s=0.002))
    result = latency.stream_once(server.url, max_tokens=12)
    assert result["ttft_ms"] > 0
    assert len(result["gaps_ms"]) == 11 and all(g >= 0 for g in result["gaps_ms"])


def test_measure_counts_requests_and_errors(fake_server) -> None:
    server = fake_server(FakeEngine(token_s=0.001))
    cell = latency.measure(server.url, seconds=0.3, max_tokens=5)
    assert cell["errors"] == 0 and cell["ttft_ms"]["n"] >= 1
    assert cell["gap_ms"]["n"] == 4 * cell["ttft_ms"]["n"]
    gone = latency.measure("http://127.0.0.1:1", seconds=0.05, max_tokens=5)
    assert gone["errors"] >= 1 and gone["ttft_ms"]["n"] == 0


def test_measure_reports_tokens_a_step_and_the_time_a_token_took(monkeypatch) -> None:
    # Scripted answers (a client's read times through HTTP vary with the machine's load):
    # 5 tokens in 3 steps, 10 ms a token; the requests cycle through the ask's questions.
    asked = []

    def answer(url, max_tokens, messages, waits=None):
        asked.append(messages)
        return {
            "ttft_ms": 10.0,
            "gaps_ms": [30.0, 10.0],
            "tokens": 5,
            "steps": 3,
            "ms_a_token": 10.0,
        }

    monkeypatch.setattr(latency, "stream_once", answer)
    cell = latency.measure("http://unused", seconds=0.01, max_tokens=5, ask="rewrite")
    requests = cell["ttft_ms"]["n"]
    assert requests >= 1 and cell["gap_ms"]["n"] == 2 * requests
    assert cell["tokens_per_step"] == round(5 / 3, 2) and cell["ms_a_token"] == 10.0
    rewrites = latency.questions("rewrite")
    assert len(rewrites) > 1 and asked[: len(rewrites)] == rewrites[: len(asked)]
    assert latency.questions("question") == [latency.ASK]


def test_stream_once_times_a_token_from_the_first_text_to_the_end(monkeypatch) -> None:
    def streamed(arrivals, tokens, latency_s=0.1, ttft_ms=20.0):
        done = {"timings": {"decode_steps": 2}}
        fields = {"arrivals": arrivals, "tokens": tokens, "done": done}
        monkeypatch.setattr(
            latency,
            "chat_once",
            lambda *a, **k: {"ttft_ms": ttft_ms, "latency_s": latency_s, **fields},
        )
        return latency.stream_once("http://unused", max_tokens=8)

    # 5 tokens, the last an end-of-text that sends no text: 80 ms after the first text
    # event over the 4 tokens after the first, whatever the events carried.
    assert streamed([1.0, 1.05, 1.06], 5)["ms_a_token"] == pytest.approx(20.0)
    assert streamed([1.0, 1.05, 1.06], 5)["steps"] == 2
    assert streamed([1.0], 5)["ms_a_token"] is None  # text held back to the end
    assert streamed([1.0], 1)["ms_a_token"] is None


def test_stream_once_against_a_server(fake_server) -> None:
    server = fake_server(FakeEngine(token_s=0.002))
    result = latency.stream_once(server.url, max_tokens=12)
    assert result["tokens"] == 12 and result["ms_a_token"] > 0 and "steps" in result


def test_first_token_waits_are_read_by_role() -> None:
    """Four threads busy on one CPU outside the GIL (hashing), two named as the inference
    threads: each waits for the CPU most of the time, so both roles' run-queue time grows
    by hundreds of ms, and the sleeping client's does not."""
    stop = threading.Event()
    ready = threading.Barrier(5, timeout=10)
    data = bytes(1 << 20)

    def busy(named: bool) -> None:
        if named:
            name_this_thread()
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
        ready.wait()
        while not stop.is_set():
            hashlib.sha256(data)  # releases the GIL: all four threads stay runnable

    threads = [threading.Thread(target=busy, args=(named,)) for named in (1, 1, 0, 0)]
    for thread in threads:
        thread.start()
    try:
        ready.wait()
        with first_token.Waits(os.getpid()) as waits:
            before = waits.now()
            time.sleep(0.3)
            after = waits.now()
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    assert set(before) == {"client", "http", "inference"}
    assert after["inference"] - before["inference"] > 50e6, (before, after)
    assert after["http"] - before["http"] > 50e6, (before, after)
    assert after["client"] - before["client"] < 50e6, (before, after)


def test_first_token_parts_add_up() -> None:
    timings = {"queued_ms": 0.5, "ttft_ms": 6.0}
    before = {"client": 0, "http": 10**6, "inference": 5 * 10**6}
    after = {"client": 2 * 10**6, "http": 4 * 10**6, "inference": 5 * 10**6}
    parts = first_token.parts(10.0, timings, before, after)
    assert parts == {
        "ttft_ms": 10.0,
        "server_ms": 6.5,
        "outside_ms": 3.5,
        "client_wait_ms": 2.0,
        "http_wait_ms": 3.0,
        "inference_wait_ms": 0.0,
    }
    cell = first_token.summarize([parts, {**parts, "ttft_ms": 20.0}, {**parts, "ttft_ms": 5.0}])
    assert [r["ttft_ms"] for r in cell["slowest"]] == [20.0, 10.0, 5.0]
    assert cell["server_ms"]["n"] == 3 and cell["client_wait_ms"]["p50"] == 2.0


def test_measure_reads_the_first_tokens_parts_of_a_server(fake_server) -> None:
    """With the server's process id (here the test's own: the server runs in it), each
    request's first token in parts, in the cell and in the table."""
    server = fake_server(FakeEngine(token_s=0.002))
    cell = latency.measure(server.url, seconds=0.3, max_tokens=5, server_pid=os.getpid())
    parts = cell["first_token"]
    assert parts["server_ms"]["n"] == cell["ttft_ms"]["n"] >= 1
    slowest = parts["slowest"][0]
    assert slowest["ttft_ms"] == pytest.approx(cell["ttft_ms"]["max"], abs=0.1)
    assert slowest["server_ms"] + slowest["outside_ms"] == pytest.approx(
        slowest["ttft_ms"], abs=0.02
    )
    assert slowest["server_ms"] >= 2.0  # the fake engine's first token: one 2 ms step
    assert "first_token" not in latency.measure(server.url, seconds=0.05, max_tokens=5)
    report = {
        "settings": {"default": "x"},
        "cells": {"default": {"quiet": {**cell, "loadavg_1m": [0.5, 1.5]}}},
    }
    text = latency.format_report(report)
    assert (
        "| default | quiet | "
        + " / ".join(f"{parts['server_ms'][q]:g}" for q in ("p50", "p90", "p99"))
        in text
    )


def test_summary_quantiles_and_jitter() -> None:
    s = stats.summary([10.0] * 98 + [30.0, 1000.0])
    assert s["p50"] == 10 and s["max"] == 1000 and s["n"] == 100
    assert s["jitter"] == pytest.approx(s["p99"] / 10, abs=0.01)
    assert set(s) == {"p50", "p90", "p99", "p99.9", "max", "jitter", "n"}


def test_settings_combine_and_describe() -> None:
    both = latency.setting("dedicated+threads-1")
    raised = launcher.profile_nice("dedicated-pc", latency.BUSY)
    assert both.flags == ("--threads", "1") and both.nice == raised < 0
    assert "--threads 1" in both.describe() and f"nice {raised:+d}" in both.describe()
    assert latency.setting("omp-passive").env == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert all(latency.setting(name) for name in latency.FULL_TABLE)
    with pytest.raises(SystemExit, match="unknown 'nope'"):
        latency.setting("default+nope")


def test_a_profiles_nice_gives_the_server_its_slices_share(tmp_path, monkeypatch) -> None:
    """The unit weighs the service's slice against user.slice (100), where all the owner's
    busy programs run; here each is an autogroup of its own at nice 0. So the raised nice
    grows with their number, and follows the profile's CPUWeight=."""
    share = {}
    for profile in ("dedicated-pc", "shared-desk"):
        for busy in (1, 2):
            weight = launcher.NICE_WEIGHTS[launcher.profile_nice(profile, busy)]
            share[profile, busy] = weight / (weight + busy * launcher.NICE_WEIGHTS[0])
    # 1000 against 100: 91 % to the service; 50 against 100: a third
    assert all(0.88 < share["dedicated-pc", busy] < 0.93 for busy in (1, 2))
    assert all(0.30 < share["shared-desk", busy] < 0.37 for busy in (1, 2))
    assert launcher.profile_nice("dedicated-pc", 2) == -13  # nice -10 alone gave 82 %
    assert launcher.profile_nice("shared-desk", 2) == 0
    (tmp_path / "heavy.slice.conf").write_text("[Slice]\n# CPUWeight=1\nCPUWeight=10000\n")
    monkeypatch.setattr(launcher, "PROFILES", tmp_path)
    assert launcher.profile_nice("heavy", 2) == -20  # past the top level: the top one


def _report(label: str) -> dict:
    cell = {
        "ttft_ms": stats.summary([50.0, 60.0]),
        "gap_ms": stats.summary([20.0, 21.0, 40.0]),
        "tokens_per_step": 1.5,
        "ms_a_token": 12.5,
        "errors": 0,
        "loadavg_1m": [0.5, 1.5],
        "noise": "cpu",
    }
    return {
        "meta": {"model": "embedded", "loadavg_1m_start": 0.5},
        "settings": {label: "server defaults"},
        "cells": {label: {"quiet": cell, "cpu": cell}},
    }


def test_table_has_every_cell_and_the_settings(tmp_path: Path) -> None:
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(_report("tuned: default")))
    b.write_text(json.dumps(_report("untuned: default")))
    text = latency.format_report(latency.merge([a, b]))
    rows = [line for line in text.splitlines() if line.startswith("| tuned: default |")]
    compact = [row for row in rows if "·" in row]
    # one compact row, one full row per condition, the noise cell against the quiet one
    assert len(rows) == 4 and len(compact) == 1
    assert sum("x / " in row for row in rows) == 1
    assert compact[0].count("·") == 2  # quiet and cpu side by side
    assert text.count("| untuned: default | cpu | 2 | 0 |") == 1
    assert text.count("| 1.5, 12.5 |") == 4  # each cell's tokens a step, ms a token
    assert "- tuned: default: server defaults" in text
    assert text.count('"loadavg_1m_start": 0.5') == 2  # both runs' meta


def test_noise_cells_are_read_against_their_settings_quiet_cell() -> None:
    """The ratios the targets are held to (docs/latency.md), worked out from the cells."""
    quiet = {
        "ttft_ms": stats.summary([10.0] * 90 + [13.0] * 10),
        "gap_ms": stats.summary([5.0] * 90 + [7.0] * 10),
        "floor": {"sample_ms": stats.summary([4.0] * 90 + [5.2] * 10)},
    }
    noisy = {
        "ttft_ms": stats.summary([11.0] * 98 + [18.0, 30.0]),
        "gap_ms": stats.summary([6.0] * 98 + [10.0, 40.0]),
    }
    cells = {"dedicated": {"quiet": quiet, "cpu": noisy}}
    lines = latency.versus_quiet_lines(cells)
    row = lines[-1]
    ttft_p99, gap_p99 = noisy["ttft_ms"]["p99"], noisy["gap_ms"]["p99"]
    assert row.startswith("| dedicated | cpu | 1.20x / ")
    assert f"/ {gap_p99 / 5.0:.2f}x |" in row
    assert f"| {ttft_p99 / 10.0:.2f}x / {ttft_p99 / quiet['ttft_ms']['p99']:.2f}x |" in row
    assert "| 1.4 (the floor's 1.3) |" in row
    assert row.endswith("| 40, 30 |")
    assert len([line for line in lines if line.startswith("| dedicated")]) == 1  # no quiet row
    assert latency.versus_quiet_lines({"default": {"cpu": noisy}}) == []  # nothing to read against
    bunched = {**quiet, "gap_ms": stats.summary([0.0, 0.0]), "floor": {"error": "ended"}}
    row = latency.versus_quiet_lines({"url": {"quiet": bunched, "cpu": noisy}})[-1]
    assert row.startswith("| url | cpu | - / - | ") and "the floor's" not in row
    report = {"settings": {"dedicated": "x"}, "cells": cells}
    for cell in cells["dedicated"].values():
        cell.update(errors=0, loadavg_1m=[0.1, 0.2])
    assert lines[-1] in latency.format_report(report)


def test_the_kernels_tick_rate_is_read_from_its_configuration(tmp_path: Path) -> None:
    config = "# CONFIG_HZ_1000 is not set\nCONFIG_HZ_250=y\nCONFIG_HZ=250\nCONFIG_X=1\n"
    packed, plain = tmp_path / "config.gz", tmp_path / "config-6.1"
    packed.write_bytes(gzip.compress(config.encode()))
    plain.write_text(config.replace("250", "1000"))
    missing, broken, torn = tmp_path / "none.gz", tmp_path / "broken.gz", tmp_path / "torn.gz"
    broken.write_bytes(b"not gzip")
    body = bytearray(packed.read_bytes())
    body[10] ^= 0xFF  # a valid header, its deflate data damaged (zlib.error)
    torn.write_bytes(bytes(body))
    silent, odd = tmp_path / "config-silent", tmp_path / "config-odd"
    silent.write_text("CONFIG_X=1\n")
    odd.write_text("CONFIG_HZ=fast\n")
    assert latency.kernel_hz((missing, broken, torn, silent, odd, packed, plain)) == 250
    assert latency.kernel_hz((missing, plain)) == 1000
    assert latency.kernel_hz((missing, broken, torn, silent, odd)) is None
    assert latency.kernel_hz(()) is None  # no copy named: none read


def test_cpu_noise_is_one_process_per_cpu_and_stops_by_pid() -> None:
    with noise.Noise("cpu", seconds=30, cpus=2) as running:
        pids = [p.pid for p in running.procs]
        assert len(pids) == 2
        assert all(os.getsid(pid) == pid for pid in pids)  # own session: own autogroup
        assert all(os.getpriority(os.PRIO_PROCESS, pid) == 0 for pid in pids)
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    with noise.Noise("quiet", seconds=30) as nothing:
        assert nothing.procs == []


def _in_thread(fn):
    """fn() in a thread of its own: a thread's nice is its own, the suite's stays as it is."""
    out: dict = {}
    thread = threading.Thread(target=lambda: out.update(value=fn()))
    thread.start()
    thread.join()
    return out["value"]


def test_a_profiles_rows_run_the_server_with_the_profiles_environment() -> None:
    """The profile rows take the Environment= lines of the profile's drop-in (not its
    commented examples), so the dedicated row asks for the unit's slice; a flag wins."""
    dedicated = launcher.profile_environment("dedicated-pc")
    assert dedicated == {
        "DESKCHAT_MLOCK": "1",
        "DESKCHAT_REALTIME_FIRST_STEP_MS": "50",
        "DESKCHAT_SCHED_SLICE_US": "100",
    }
    assert latency.setting("dedicated").env == dedicated
    assert latency.setting("dedicated").slice_us() == 100
    assert latency.setting("dedicated+slice-default").slice_us() == 0  # the flag wins
    assert latency.setting("shared-desk").slice_us() == 0  # no slice where the owner is first


@pytest.mark.skipif(os.geteuid() != 0, reason="raising a priority needs root")
def test_dedicated_client_measures_at_nice_minus_10_and_its_noise_at_0() -> None:
    """The dedicated profile's client runs at the server's raised priority and its
    slice, the noise it starts meanwhile at nice 0 and the kernel's slice all the same, and
    the client's nice and slice are put back after."""

    def measure_like_the_bench():
        before = os.getpriority(os.PRIO_PROCESS, 0), slice_ns("thread-self")
        with launcher.client_priority(-10, 300):
            during = os.getpriority(os.PRIO_PROCESS, 0), slice_ns("thread-self")
            with noise.Noise("cpu", seconds=30, cpus=1) as running:
                pid = running.procs[0].pid  # Popen returns once it is exec'd
                noisy = os.getpriority(os.PRIO_PROCESS, pid), slice_ns(pid)
        with launcher.client_priority(10):  # shared-desk: the client stays as it is
            lowered = os.getpriority(os.PRIO_PROCESS, 0), slice_ns("thread-self")
        after = os.getpriority(os.PRIO_PROCESS, 0), slice_ns("thread-self")
        return before, during, noisy, lowered, after

    before, during, noisy, lowered, after = _in_thread(measure_like_the_bench)
    assert during[0] == -10 and noisy[0] == 0
    assert lowered == after == before
    if slices_settable():
        assert during[1] == 300_000 != before[1]
        assert noisy[1] == before[1]


@pytest.mark.skipif(os.geteuid() != 0, reason="a real-time policy needs root")
def test_a_real_time_client_starts_its_noise_at_the_normal_policy() -> None:
    """A client measuring at SCHED_FIFO (as a probe of the client's own waits did) must not
    hand that policy to the busy processes: they would run ahead of the server."""

    def start_noise_from_fifo():
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
        try:
            with noise.Noise("cpu", seconds=30, cpus=1) as running:
                pid = running.procs[0].pid
                return os.sched_getscheduler(pid), os.getpriority(os.PRIO_PROCESS, pid)
        finally:
            os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))

    assert _in_thread(start_noise_from_fifo) == (os.SCHED_OTHER, 0)


@pytest.mark.slow
def test_the_floor_runs_the_native_loop_at_the_settings_priority() -> None:
    measured = machine_floor.beside(launcher.Setting(nice=5), ms=2.0, seconds=0.5)
    assert measured["nice"] == 5 and measured["threads"] == physical_cores()
    assert measured["repeats"] >= 1 and measured["sample_ms"]["n"] >= 5
    samples = measured["sample_ms"]
    assert 0 < samples["p50"] <= samples["p99"] <= samples["max"]
    cell = {
        "gap_ms": stats.summary([8.0, 9.0]),
        "ttft_ms": stats.summary([20.0]),
        "floor": measured,
    }
    assert f"floor x{samples['jitter']:g}" in latency.cell_text(cell)
    broken = {**cell, "floor": {"error": "no native build runs here"}}
    assert latency.cell_text(broken).endswith("floor: no native build runs here")


def test_a_noise_cells_floor_is_the_quiet_floors_work_while_the_noise_runs(monkeypatch) -> None:
    """After a noise cell's requests, run_cell measures the floor while the noise still runs,
    with the quiet floor's repeats, and gives its p50 and p99 over the quiet floor's p50; a
    noise cell without a quiet floor has none. (The floor itself: the test above.)"""
    asked, alive = [], []

    def fake_beside(chosen, ms, seconds, repeats=None):
        asked.append((ms, repeats))
        return {"sample_ms": stats.summary([12.0] * 98 + [30.0] * 2), "repeats": repeats}

    monkeypatch.setattr(latency.machine_floor, "beside", fake_beside)
    monkeypatch.setattr(latency, "measure", lambda *a: {"gap_ms": stats.summary([8.0])})
    quiet = {"sample_ms": stats.summary([8.0, 8.0, 9.0]), "repeats": 40}
    floor = latency.floor_for(launcher.Setting(), "cpu", quiet)

    def floor_seeing_the_noise(cell):
        alive.append([proc.poll() is None for proc in running[0].procs])
        return floor(cell)

    running = []
    real_noise = latency.Noise

    def noise_kept(*args, **kwargs):
        running.append(real_noise(*args, **kwargs))
        return running[-1]

    monkeypatch.setattr(latency, "Noise", noise_kept)
    args = argparse.Namespace(seconds=0.1, max_tokens=8, ask="question", memory_mb=None)
    cell = latency.run_cell(
        "http://unused", "cpu", args, Path("unused"), print, floor_seeing_the_noise
    )
    assert alive == [[True] * noise.busy_programs()]
    assert asked == [(8.0, 40)]
    assert cell["floor"]["vs_quiet"] == [1.5, 3.75]  # 12 and 30 ms over 8
    p50, p99 = cell["floor"]["vs_quiet"]
    assert latency.cell_text({**cell, "ttft_ms": stats.summary([20.0])}).endswith(
        f"floor {p50:g}x/{p99:g}x"
    )
    assert latency.floor_for(launcher.Setting(), "cpu", None) is None
    assert latency.floor_for(launcher.Setting(), "cpu", {"error": "no native build"}) is None


def test_memory_noise_takes_what_it_may_and_reads_the_file(tmp_path: Path) -> None:
    file = tmp_path / "cache.bin"
    with noise.Noise("memory", seconds=30, memory_cap_mb=128, file=file, file_mb=8) as running:
        assert running.report.startswith("ready 128 MB held")
        status = Path(f"/proc/{running.procs[0].pid}/status").read_text()
        rss_kb = int(next(x for x in status.splitlines() if x.startswith("VmRSS:")).split()[1])
        assert rss_kb >= 128 * 1024  # touched, not only reserved
    assert file.stat().st_size == 8 << 20


def test_memory_noise_never_goes_below_the_margin(monkeypatch) -> None:
    """It stops taking memory before MemAvailable would fall under the margin."""
    margin, chunk = 1 << 30, noise.CHUNK
    available = iter([margin + 2 * chunk, margin + chunk, margin + chunk - 1])
    monkeypatch.setattr(noise, "meminfo_bytes", lambda _field: next(available))
    assert len(noise.take_memory(None, margin)) == 2
    available = iter([margin + 9 * chunk] * 9)
    assert len(noise.take_memory(2 * chunk, margin)) == 2  # the cap holds too


def test_unknown_condition_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown condition"):
        noise.Noise("disk", seconds=1)
