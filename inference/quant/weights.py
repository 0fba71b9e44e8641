"""The one per-row int8 weight quantizer that both int8 paths call (per-row fbgemm, torch.ao).

Symmetric, one scale per output channel, a block of rows at a time so that the float
temporaries stay a few MB even for a 150k-row lm_head. The two paths differ only in their
integer range and scale floor, which each passes in.
"""

from __future__ import annotations

import torch

ROWS_PER_CHUNK = 4096  # weight rows quantized at a time


def per_row_int8(
    weight: torch.Tensor,
    column_scale: torch.Tensor | None = None,
    *,
    divisor: float,
    low: int,
    floor: float,
    scale_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 [N, K], scale [N] of `scale_dtype`): each row divided by its absolute maximum
    over `divisor` (at least `floor`), rounded half to even and clamped to [low, 127]. The
    weight's columns are multiplied by `column_scale` first (smoothing), in float32."""
    n = weight.shape[0]
    q = torch.empty(weight.shape, dtype=torch.int8)
    scale = torch.empty(n, dtype=scale_dtype)
    for start in range(0, n, ROWS_PER_CHUNK):
        rows = slice(start, start + ROWS_PER_CHUNK)
        w = weight.detach()[rows].to(torch.float32, copy=True)
        if column_scale is not None:
            w.mul_(column_scale)
        s = w.abs().amax(dim=1).div_(divisor).clamp_(min=floor)
        q[rows] = w.div_(s[:, None]).round_().clamp_(low, 127).to(torch.int8)
        scale[rows] = s
    return q, scale
