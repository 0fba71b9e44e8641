"""How many prompt rows ride beside answering streams (inference/runtime/chunking.py), from
step times given to it: the chunk keeps a step within about SLOWER times a step without."""

from __future__ import annotations

from inference.runtime.chunking import MOST, SLOWER, PromptChunks
from inference.runtime.schedule import PREFILL_BESIDE


def test_the_fixed_chunk_until_both_costs_are_measured():
    chunks = PromptChunks(align=1)
    assert chunks.beside() == PREFILL_BESIDE
    chunks.observe(3, 0, 0.030)  # a decode step of three streams
    assert chunks.beside() == PREFILL_BESIDE
    chunks.observe(0, 256, 256 * 0.004)  # a prompt alone: 4 ms a row
    assert chunks.beside() == int((SLOWER - 1) * 0.030 / 0.004)  # 7 rows: 30 + 28 ms


def test_a_step_beside_answers_teaches_the_prompt_rows_cost():
    chunks = PromptChunks(align=1)
    chunks.observe(3, 0, 1 / 32)
    for _ in range(40):  # steps of 3 answer rows and 4 prompt rows, 3 / 32 s each
        chunks.observe(3, 4, 3 / 32)
    assert chunks.beside() == 2  # 1/64 s a prompt row: 2 rows double the step
    assert chunks.decode_s == 1 / 32  # steps with prompt rows leave the decode cost alone


def test_a_busy_pc_slows_both_and_the_chunk_stays():
    quiet, busy = PromptChunks(align=1), PromptChunks(align=1)
    for chunks, slow in ((quiet, 1.0), (busy, 1.8)):
        chunks.observe(3, 0, 0.030 * slow)
        chunks.observe(0, 256, 256 * 0.004 * slow)
    assert quiet.beside() == busy.beside()


def test_whole_blocks_off_the_native_step_and_bounds():
    chunks = PromptChunks(align=16)
    chunks.observe(3, 0, 0.030)
    chunks.observe(0, 256, 256 * 0.004)
    assert chunks.beside() == 16  # at least one block, even where 7 rows would do
    chunks.observe(3, 0, 10.0)  # a very slow decode step: the chunk grows, up to MOST
    assert chunks.beside() == MOST
    cheap = PromptChunks(align=1)
    cheap.observe(3, 0, 0.030)
    cheap.observe(0, 256, 0.0)  # rows that cost nothing measurable
    assert cheap.beside() == PREFILL_BESIDE
