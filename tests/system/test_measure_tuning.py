"""system/measure-tuning.sh against a fake kernel tree, with a stand-in for the benchmark run.

The stand-in writes the report a real `python -m bench --latency` run would, naming the
swappiness it saw, so the test knows under which tuning each run happened; `--merge` goes
to the real bench code.
"""

from __future__ import annotations

import sys
from pathlib import Path

from tests.support.systree import SYSTEM, make_tree, run, snapshot, tune, unprivileged

MEASURE = SYSTEM / "measure-tuning.sh"

STAND_IN = """#!/usr/bin/env bash
# python -m bench --latency ...: the real one for --merge, a fake run otherwise.
if [[ " $* " == *" --merge "* ]]; then exec {python} "$@"; fi
echo "$*" >>"{calls}"
label="" json=""
while (( $# )); do
  case "$1" in --label) label="$2"; shift ;; --json) json="$2"; shift ;; esac
  shift
done
seen="$(<"${{DESKCHAT_SYSROOT}}/proc/sys/vm/swappiness")"
cat >"${{json}}" <<JSON
{{"meta": {{"model": "stand-in"}}, "settings": {{"${{label}}: default": "swappiness ${{seen}}"}},
 "cells": {{"${{label}}: default": {{"quiet": {{
   "ttft_ms": {{"p50": 50, "p90": 55, "p99": 60, "p99.9": 61, "max": 61, "jitter": 1.2, "n": 9}},
   "gap_ms": {{"p50": 20, "p90": 21, "p99": 30, "p99.9": 31, "max": 31, "jitter": 1.5, "n": 90}},
   "errors": 0, "loadavg_1m": [0.1, 0.2], "noise": "quiet"}}}}}}}}
JSON
"""


def stand_in(tmp_path: Path) -> tuple[Path, Path]:
    calls = tmp_path / "calls.txt"
    script = tmp_path / "python"
    script.write_text(STAND_IN.format(python=sys.executable, calls=calls))
    script.chmod(0o755)
    return script, calls


def measure(root: Path, python: Path, *args: str):
    return run([MEASURE, *args], root, env={"DESKCHAT_BENCH_PYTHON": str(python)})


def test_measures_tuned_then_untuned_and_leaves_the_tree_untouched(tmp_path: Path) -> None:
    root = make_tree(tmp_path / "root")
    python, calls = stand_in(tmp_path)
    before = snapshot(root)
    result = measure(root, python, "--settings", "default", "--seconds", "5")
    assert result.returncode == 0, result.stderr
    assert "- tuned: default: swappiness 10" in result.stdout  # tune.sh's value
    assert "- untuned: default: swappiness 60" in result.stdout  # the machine's own
    assert "| tuned: default | 20/30 (x1.5) · 50/60 |" in result.stdout
    assert "| untuned: default | quiet |" in result.stdout
    lines = calls.read_text().splitlines()
    assert len(lines) == 2 and all("--settings default --seconds 5" in x for x in lines)
    assert "--label tuned" in lines[0] and "--label untuned" in lines[1]
    assert snapshot(root) == before


def test_tuning_applied_before_is_applied_after(tmp_path: Path) -> None:
    root = make_tree(tmp_path / "root")
    python, _ = stand_in(tmp_path)
    assert tune(root, "apply").returncode == 0  # as deskchat-tune does at boot
    tuned = snapshot(root)
    result = measure(root, python)
    assert result.returncode == 0, result.stderr
    assert "- untuned: default: swappiness 60" in result.stdout
    assert snapshot(root) == tuned  # the saved originals too


def test_a_failed_run_still_leaves_the_tree_as_found(tmp_path: Path) -> None:
    root = make_tree(tmp_path / "root")
    before = snapshot(root)
    failing = tmp_path / "python"
    failing.write_text("#!/usr/bin/env bash\nexit 7\n")
    failing.chmod(0o755)
    result = measure(root, failing)
    assert result.returncode == 7
    assert snapshot(root) == before


def test_refuses_without_root() -> None:
    result = run([MEASURE], None, prefix=unprivileged())
    assert result.returncode == 2 and "run it as root" in result.stderr
