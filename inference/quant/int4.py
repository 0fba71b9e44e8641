"""Int4 weight-only Linear on `torch.ops.aten._weight_int4pack_mm_for_cpu`.

Weights are quantized group-wise (group of 64 along the input dimension), asymmetric,
round-to-nearest, and packed once at load time; activations are cast to bf16 for the kernel
and back. This module owns the packing format and nothing else: which layers get it is
decided in inference/loading/checkpoint.py.
"""

from __future__ import annotations

import torch
from torch import nn

GROUP_SIZE = 64
INNER_K_TILES = 2


def fits_int4(out_features: int, in_features: int) -> bool:
    """Shapes the packing kernel takes: whole groups along K, and N a multiple of 16."""
    return in_features % GROUP_SIZE == 0 and out_features % 16 == 0


def quantize_weight(weight: torch.Tensor, group_size: int = GROUP_SIZE):
    """(packed uint8 weight, bf16 scales-and-zeros [K/group, N, 2]) for a [N, K] weight.

    The kernel de-quantizes as (q - 8) * scale + zero, so zero = min + 8 * scale.
    """
    n, k = weight.shape
    if k % group_size:
        raise ValueError(f"in_features {k} is not a multiple of the group size {group_size}")
    grouped = weight.detach().float().reshape(n, k // group_size, group_size)
    low = grouped.amin(dim=-1, keepdim=True)
    high = grouped.amax(dim=-1, keepdim=True)
    scale = ((high - low) / 15).clamp(min=1e-8)
    q = ((grouped - low) / scale).round_().clamp_(0, 15).to(torch.int32).reshape(n, k)
    zero = low + 8 * scale
    scales_zeros = torch.cat([scale, zero], dim=-1).transpose(0, 1).contiguous()
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, INNER_K_TILES)
    return packed, scales_zeros.to(torch.bfloat16)


class Int4Linear(nn.Module):
    """Drop-in for nn.Linear (inference only); input and output keep the caller's dtype."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, group_size: int = GROUP_SIZE
    ):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.group_size = group_size
        packed, scales_zeros = quantize_weight(weight, group_size)
        self.register_buffer("packed", packed)
        self.register_buffer("scales_zeros", scales_zeros)
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16)
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(
            flat, self.packed, self.group_size, self.scales_zeros
        ).to(x.dtype)
        if self.bias is not None:
            out = out + self.bias.to(x.dtype)
        return out.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, group={self.group_size}"
