"""One answer on every PC (issue 33): the embedded model converted and served under each of
torch's CPU capabilities this CPU runs (ATEN_CPU_CAPABILITY default, avx2, avx512) and on
the old CPUs' native builds (DESKCHAT_NATIVE_ISA) gives the same converted file, the same
served weights and the same greedy answers. Before, default and avx2 gave other int8
weights and 6 of 10 answers differed; on an AVX-512 Xeon, 9 of 10."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.support.answers import QUESTIONS, capabilities
from tests.support.paths import ROOT


def run(cache, **env) -> dict:
    """tests/support/answers.py in a process of its own, with `env` set."""
    environ = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
    done = subprocess.run(
        [sys.executable, "-m", "tests.support.answers", str(cache)],
        cwd=ROOT,
        env={**environ, **env},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_every_kernel_set_and_native_build_gives_the_same_weights_and_answers(tmp_path):
    sides = {}
    for capability in capabilities():  # each converts the GGUF afresh, then loads
        sides[capability] = run(tmp_path / capability, ATEN_CPU_CAPABILITY=capability)
    last = tmp_path / capabilities()[-1]
    sides["native sse4.2"] = run(last, DESKCHAT_NATIVE_ISA="sse4.2")
    steps = {name: side["decode_step"] for name, side in sides.items()}
    assert steps["native sse4.2"] == "native sse4.2", steps
    assert len(set(steps.values())) >= 2, steps  # more than one native build was compared
    first = sides["default"]
    assert len(first["answers"]) == len(QUESTIONS) == 20
    for name, side in sides.items():
        for key in ("file_sha256", "weights_sha256"):
            assert side[key] == first[key], (name, key)
        for question, want, got in zip(QUESTIONS, first["answers"], side["answers"], strict=True):
            assert got == want, (name, question)
