"""torch.ao's dynamic int8 Linear (and the int4 one), for CPUs where per-row int8 fails its
self-check and for architectures the layer-by-layer build does not know. Not batch-invariant:
torch.ao quantizes activations per tensor. The loader (inference/loading/checkpoint.py)
decides which Linear a layer gets.
"""

from __future__ import annotations

import torch
from torch import nn

from inference.quant.weights import per_row_int8


def int8_linear(
    weight: torch.Tensor, bias: torch.Tensor | None, column_scale: torch.Tensor | None = None
) -> nn.Module:
    """torch.ao dynamic int8 Linear with per-channel symmetric weights (what its
    per_channel_dynamic_qconfig observer computes), quantized a block of rows at a time.
    `column_scale` multiplies the weight's columns first (smoothing of a tied lm_head)."""
    from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear

    out_features, in_features = weight.shape
    eps = torch.finfo(torch.float32).eps
    q, scale = per_row_int8(
        weight, column_scale, divisor=127.5, low=-128, floor=eps, scale_dtype=torch.float64
    )
    zero = torch.zeros(out_features, dtype=torch.int64)
    qweight = torch._make_per_channel_quantized_tensor(q, scale, zero, 0)
    del q  # before packing: three int8 copies of a big weight at once would set the peak
    # Built 1x1 and then given its weight: the constructor would pack a full-size dummy.
    linear = DynamicLinear(1, 1, bias_=bias is not None, dtype=torch.qint8)
    linear.in_features, linear.out_features = in_features, out_features
    linear.set_weight_bias(qweight, None if bias is None else bias.detach().float())
    return linear


class SplitLinear(nn.Module):
    """A Linear quantized in blocks of output rows, outputs concatenated: quantizing a
    151936-row lm_head in one piece would hold several int8 copies of it at once."""

    def __init__(self, parts: list[nn.Module]):
        super().__init__()
        self.parts = nn.ModuleList(parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.parts], dim=-1)


HEAD_ROWS_PER_PART = 16384


def quantized_linear(
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    quantize: str,
    column_scale: torch.Tensor | None = None,
) -> nn.Module:
    if quantize in ("int8", "int8-row"):  # int8-row reaches here only as its fallback
        return int8_linear(weight, bias, column_scale)
    if column_scale is not None:
        weight = weight.float() * column_scale
    if quantize == "int4":
        from inference.quant.int4 import Int4Linear, fits_int4

        if fits_int4(*weight.shape):
            return Int4Linear(weight, bias)
        return int8_linear(weight, bias)  # a shape the int4 kernel refuses
    raise ValueError(f"not a quantization: {quantize!r}")


def quantize_linears(module: nn.Module, quantize: str) -> None:
    """Replace every nn.Linear below `module` by its quantized form."""
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            setattr(module, name, quantized_linear(child.weight, child.bias, quantize))
        else:
            quantize_linears(child, quantize)
