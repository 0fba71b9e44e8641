"""4-bit weights (inference/quant/rowint4.py): the packing step.c reads, and how close the
grid S s u - M t comes to a weight. Its products are in tests/inference/native; its bytes
under every torch kernel set in test_exact.py."""

from __future__ import annotations

import torch

from inference.quant import rowint4


def test_nibbles_pack_as_step_c_reads_them():
    u = torch.arange(128, dtype=torch.uint8).remainder(16).view(1, 128)
    packed = rowint4.pack(u)
    # byte j of a block of 64: element j low, element 32 + j high
    assert packed[0, 0] == u[0, 0] | (u[0, 32] << 4) and packed[0, 32] == u[0, 64] | (u[0, 96] << 4)
    assert torch.equal(rowint4.unpack(packed), u)


def test_a_grid_with_an_offset_per_group_is_kept_nearly_exactly():
    """Weights that are 4-bit already with a step and a minimum per group of 32 (llama.cpp's
    Q4_1, what the embedded model was shipped as) come back within the 8-bit precision of
    the steps and offsets, which is relative to the channel's largest: with steps over 3x
    in a channel, the same nibbles (a group 20x below its channel's largest would be off by
    about a step: the price of 8-bit steps and offsets instead of float ones)."""
    gen = torch.Generator().manual_seed(0)
    n, k = 64, 256
    u = torch.randint(0, 16, (n, k // 32, 32), generator=gen).float()
    u[..., 0], u[..., 1] = 0, 15  # each group spans its grid
    d = torch.rand(n, k // 32, 1, generator=gen) * 0.01 + 0.005
    m = -8 * d * (1 + 0.2 * torch.randn(n, k // 32, 1, generator=gen))
    w = (u * d + m).view(n, k)
    back = rowint4.dequantize(*rowint4.quantize_weight(w))
    error = (back - w).abs().view(n, k // 32, 32) / d
    assert float(error.max()) < 0.5  # within half a step: the same nibbles
    assert float(error.mean()) < 0.05


def test_random_weights_lose_what_4_bits_lose():
    """Gaussian weights: relative error 0.077 measured (a symmetric grid of q in [-8, 7]
    with 8-bit group scales gave 0.087)."""
    w = torch.randn(256, 1536, generator=torch.Generator().manual_seed(1))
    back = rowint4.dequantize(*rowint4.quantize_weight(w))
    assert float((back - w).norm() / w.norm()) < 0.08
