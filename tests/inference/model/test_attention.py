"""Prompt attention in fixed key blocks (inference/model/attention.py): a row's bits do not
depend on how its prompt was chunked, and the values are the math path's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from inference.model.attention import prompt_attention

KV_HEADS, GROUP, DIM, SCALE = 3, 3, 64, 0.125  # SmolLM2's attention shape


def inputs(length: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(length, KV_HEADS, GROUP, DIM, generator=gen)
    keys = torch.randn(KV_HEADS, length, DIM, generator=gen)
    values = torch.randn(KV_HEADS, length, DIM, generator=gen)
    return q, keys, values


def chunked(q, keys, values, chunk: int) -> torch.Tensor:
    out = []
    for start in range(0, q.shape[0], chunk):
        end = min(q.shape[0], start + chunk)
        out.append(prompt_attention(q[start:end], keys[:, :end], values[:, :end], start, SCALE))
    return torch.cat(out)


@pytest.mark.parametrize("length", [9, 33, 150, 300])
@pytest.mark.parametrize("threads", [1, 2])
def test_every_chunking_gives_the_same_bits(length: int, threads: int, keep_threads) -> None:
    # One-row chunks and key counts past ~128 are where torch's own kernels rounded
    # differently on an AVX2 EPYC (a one-row last chunk, then every row past 160).
    torch.set_num_threads(threads)
    q, keys, values = inputs(length)
    whole = prompt_attention(q, keys, values, 0, SCALE)
    for chunk in (1, 3, 16, 64, 256):
        assert torch.equal(chunked(q, keys, values, chunk), whole), chunk


def test_values_are_the_math_paths() -> None:
    q, keys, values = inputs(200, seed=1)
    rows = q.shape[0]
    flat = q.permute(1, 2, 0, 3).reshape(KV_HEADS, GROUP * rows, DIM)
    mask = (torch.arange(rows)[None] <= torch.arange(rows)[:, None]).repeat(GROUP, 1)
    want = F.scaled_dot_product_attention(flat, keys, values, attn_mask=mask, scale=SCALE)
    want = want.view(KV_HEADS, GROUP, rows, DIM).permute(2, 0, 1, 3).reshape(rows, -1)
    assert torch.allclose(prompt_attention(q, keys, values, 0, SCALE), want, atol=1e-5)
