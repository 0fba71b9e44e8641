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

import pytest

from tests.support.answers import QUESTIONS, capabilities
from tests.support.paths import ROOT


def start(cache, **env) -> subprocess.Popen:
    """tests/support/answers.py in a process of its own, with `env` set."""
    environ = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
    return subprocess.Popen(
        [sys.executable, "-m", "tests.support.answers", str(cache)],
        cwd=ROOT,
        env={**environ, "DESKCHAT_THREADS": "1", "OMP_NUM_THREADS": "1", **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def result(child: subprocess.Popen) -> dict:
    out, err = child.communicate(timeout=600)
    assert child.returncode == 0, err[-3000:]
    return json.loads(out.splitlines()[-1])


def assert_same(sides: dict[str, dict]) -> None:
    """Every side has the first one's converted file, weights and answers."""
    first = next(iter(sides.values()))
    assert len(first["answers"]) == len(QUESTIONS) == 20
    for name, side in sides.items():
        for key in ("file_sha256", "weights_sha256"):
            assert side[key] == first[key], (name, key)
        for question, want, got in zip(QUESTIONS, first["answers"], side["answers"], strict=True):
            assert got == want, (name, question)


def test_every_kernel_set_and_native_build_gives_the_same_weights_and_answers(embedded_dir):
    """The test cache's conversion loaded (its int8 rows, scales and smoothing computed)
    and asked twice at once, on one thread each: under the plainest kernel set on the
    sse4.2 build (a Nehalem's), and under the best this CPU runs on its own build. (Every
    build's logits, bit for bit: tests/inference/native; the middle kernel set of an AVX-512
    CPU: the slow test below.)"""
    sets = capabilities()
    cache = embedded_dir.parent.parent  # the test cache
    children = {
        "sse4.2": start(cache, ATEN_CPU_CAPABILITY=sets[0], DESKCHAT_NATIVE_ISA="sse4.2"),
        "own": start(cache, ATEN_CPU_CAPABILITY=sets[-1]),
    }
    sides = {name: result(child) for name, child in children.items()}
    steps = {name: side["decode_step"] for name, side in sides.items()}
    assert steps["sse4.2"] == "native sse4.2" and steps["own"].startswith("native"), steps
    assert_same(sides)


@pytest.mark.slow  # transformers' GGUF reader takes ~60 s
def test_the_gguf_converts_to_the_same_file_under_every_kernel_set(tmp_path, embedded_dir):
    """The embedded model's GGUF converted afresh under the plainest kernel set gives the
    file the test cache holds (converted by this session's first process, under the best),
    and the same weights and answers; so does each kernel set between them."""
    sets = capabilities()
    sides = {"fresh": result(start(tmp_path, ATEN_CPU_CAPABILITY=sets[0]))}
    for capability in sets[1:]:
        sides[capability] = result(
            start(embedded_dir.parent.parent, ATEN_CPU_CAPABILITY=capability)
        )
    assert_same(sides)
