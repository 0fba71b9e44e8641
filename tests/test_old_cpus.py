"""server.py on the old office PCs it is for, emulated by `qemu-x86_64 -cpu MODEL` (Debian
package qemu-user): it starts, logs the path it chose, shows it in /health and answers
"Tokyo" (with the native step built for it, and without); with the native step it serves the
same weights and gives the same answers as the host (issue 33); a setting the CPU cannot
run is refused at start instead of dying with SIGILL.
Emulation is slow (a start takes minutes), so these are few and short."""

from __future__ import annotations

import shutil

import pytest

from tests.support.httpclient import chat, request
from tests.support.systree import skip_unless_ci

# Not France: its first token is a near-tie in fp32 ("The" -1.883 vs "L" -1.965), which
# qnnpack's rounding tips to "L'Alma, ..."; Japan's fp32 margins are >= 2.5 logits up to
# "Tokyo" (tests/support/margins.py).
QUESTION = {"message": "What is the capital of Japan?", "max_tokens": 8}
# Compared with the host's answers word for word: two more, with near-ties on the way
# (tests/support/margins.py: "Name three colors." 0.039, "List three fruits." 0.054).
SAME_AS_HOST = [
    QUESTION,
    {"message": "Name three colors.", "max_tokens": 16},
    {"message": "List three fruits.", "max_tokens": 16},
]


@pytest.fixture
def qemu() -> list[str]:
    """The command prefix that runs server.py on an emulated CPU (niced: it is heavy)."""
    path = shutil.which("qemu-x86_64")
    if path is None:
        skip_unless_ci("qemu-x86_64 (Debian package qemu-user) is not installed")
    # OpenBLAS (numpy's) picks its kernels by its own CPU detection, which under qemu-user
    # on an AVX-512 AMD host chose one Nehalem cannot run: `import numpy` died of SIGILL
    # there (not on a real Nehalem, nor under qemu on an Intel host). Its oldest kernel set
    # of these models, named, keeps the emulation about deskchat's code.
    return ["nice", "-n", "10", path, "-E", "OPENBLAS_CORETYPE=Nehalem", "-cpu"]


@pytest.mark.slow  # emulated: minutes per start
@pytest.mark.parametrize("model, isa", [("Nehalem", "sse4.2"), ("SandyBridge", "avx")])
def test_starts_and_answers_on_an_old_cpu(
    model, isa, qemu, start_server, embedded_dir, embedded_server
):
    """The native step, built for the emulated CPU's level, serves per-row int8 there: the
    same weights as on the host, hence the same answers (the host's server beside it)."""
    # embedded_dir: converted natively first, so the emulated start only loads it.
    server = start_server("--model", "embedded", wrapper=[*qemu, model], ready=False)
    server.wait_ready(timeout=900)
    health = request(server.url, "GET", "/health").json()
    shown = health["cpu"]
    assert (shown["isa"], shown["paths"]["int8_row"], shown["quantize"]) == (
        isa,
        "native",
        "int8-row",
    )
    assert health["decode_step"] == f"native {isa}"
    host = request(embedded_server.url, "GET", "/health").json()
    assert health["weights_sha256"] == host["weights_sha256"]
    for question in SAME_AS_HOST:
        reply = chat(server.url, question, timeout=600)
        assert reply.status == 200, reply.body
        want = chat(embedded_server.url, question).json()["response"]
        assert reply.json()["response"] == want, question
    assert "Tokyo" in chat(embedded_server.url, QUESTION).json()["response"]


@pytest.mark.slow  # emulated: minutes per start
def test_without_the_native_step_an_old_cpu_serves_torch_ao_int8(qemu, start_server, embedded_dir):
    server = start_server(
        "--model", "embedded", "--no-native", wrapper=[*qemu, "Nehalem"], ready=False
    )
    server.wait_ready(timeout=900)
    health = request(server.url, "GET", "/health").json()
    shown = health["cpu"]
    assert (shown["isa"], shown["paths"]["int8"], shown["quantize"]) == (
        "sse4.2",
        "qnnpack",
        "int8",
    )
    assert shown["paths"]["int8_row"] == "none"
    assert health["decode_step"] == "torch"
    reply = chat(server.url, QUESTION, timeout=600)
    assert reply.status == 200, reply.body
    assert "Tokyo" in reply.json()["response"]
    chosen = [line for line in server.log().splitlines() if "cpu sse4.2: int8 qnnpack," in line]
    assert len(chosen) == 1, server.log()


@pytest.mark.slow
def test_onednn_int8_is_refused_on_nehalem_instead_of_dying(qemu, start_server):
    """oneDNN's int8 Linear dies with SIGILL there (exit 132 before this issue)."""
    server = start_server(
        "--model", "embedded", "--int8-engine", "onednn", wrapper=[*qemu, "Nehalem"], ready=False
    )
    assert server.proc.wait(300) == 2
    lines = [line for line in server.log().splitlines() if "TCG doesn't support" not in line]
    assert len(lines) == 1 and lines[0].startswith("server.py: --int8-engine onednn"), lines
    assert "usable here: qnnpack" in lines[0]


@pytest.mark.slow
def test_int8_row_runs_natively_below_avx2(start_server):
    """Natively, with torch's kernels capped below AVX2 (as on a Sandy Bridge): the native
    step's AVX build serves per-row int8 and answers."""
    server = start_server(
        "--model", "embedded", "--quantize", "int8-row", env={"ATEN_CPU_CAPABILITY": "default"}
    )
    health = request(server.url, "GET", "/health").json()
    assert health["decode_step"] == "native avx"
    assert health["cpu"]["paths"]["int8_row"] == "native"
    reply = chat(server.url, QUESTION, timeout=120)
    assert reply.status == 200, reply.body
    assert "Tokyo" in reply.json()["response"]


def test_int8_row_is_refused_without_avx2_and_without_the_native_step(start_server):
    """Natively, with torch's kernels capped below AVX2 (as on a Sandy Bridge) and --no-native:
    one line, exit 2, before anything loads."""
    server = start_server(
        "--model",
        "embedded",
        "--quantize",
        "int8-row",
        "--no-native",
        env={"ATEN_CPU_CAPABILITY": "default"},
        ready=False,
    )
    assert server.proc.wait(60) == 2
    lines = server.log().splitlines()
    assert len(lines) == 1 and lines[0].startswith("server.py: --quantize int8-row"), lines
    assert "AVX2" in lines[0] and "Traceback" not in server.log()
