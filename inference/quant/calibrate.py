"""The calibration forward that smoothing reads its activation maxima from, with the same
bits on every CPU.

Smoothing (inference/quant/smooth.py) divides each input channel by a scale made from the
largest activation a short text gives it. Taken from transformers' own layer forward, those
maxima followed torch's kernels (MKL's products, vectorized softmax and SiLU): under
ATEN_CPU_CAPABILITY default and avx2 the same checkpoint gave different int8 weights, and 6
of 10 greedy answers differed. Here one Llama/Qwen2-style layer runs in float64 on
inference/quant/exact.py's operations alone: the maxima, hence the scales and the weights,
are the same on every PC. Precision is ~20 bits of each row's largest value per product,
plenty for a maximum that only sets a scale. It knows nothing of checkpoints or quantizing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from inference.quant import exact


@dataclass
class Maxima:
    """max |input| per channel of a layer's three smoothed groups' readers, float64."""

    qkv: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


def supported(layer: nn.Module) -> bool:
    """Whether `layer` is the plain Llama/Qwen2 layer (SiLU MLP, optional q/k/v bias,
    optional per-head q/k norms) this forward reproduces."""
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    parts = (
        (attn, ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim")),
        (mlp, ("gate_proj", "up_proj", "down_proj", "act_fn")),
        (layer, ("input_layernorm", "post_attention_layernorm")),
    )
    if any(owner is None or not all(hasattr(owner, a) for a in names) for owner, names in parts):
        return False
    plain = [attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj]
    return type(mlp.act_fn).__name__ == "SiLUActivation" and all(
        getattr(lin, "bias", None) is None for lin in plain
    )


def _eps(norm: nn.Module) -> float:
    return float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))


def rms_norm(x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    """transformers' RMSNorm (weight * x / sqrt(mean(x^2) + eps)), float64."""
    mean = exact.sum_of_squares(x) / x.shape[-1]
    return (x * (1.0 / torch.sqrt(mean + _eps(norm)))) * norm.weight.double()


def _linear(x: torch.Tensor, *linears: nn.Module) -> list[torch.Tensor]:
    """x through each of `linears` (one product for all: they share x's rounding)."""
    y = exact.matmul(x, *(lin.weight.detach() for lin in linears))
    y = y.split([lin.out_features for lin in linears], dim=-1)
    return [
        part if lin.bias is None else part + lin.bias.detach().double()
        for part, lin in zip(y, linears, strict=True)
    ]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., T, d] * cos + rotate_half(x) * sin, transformers' apply_rotary_pos_emb."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _heads(x: torch.Tensor, d: int, norm: nn.Module | None) -> torch.Tensor:
    """[T, n * d] -> [n, T, d], each head through `norm` if the model has one (Qwen3)."""
    heads = x.unflatten(-1, (-1, d)).transpose(0, 1)
    return heads if norm is None else rms_norm(heads, norm)


def _attention(layer: nn.Module, x: torch.Tensor, cos, sin) -> torch.Tensor:
    """Causal self-attention of one sequence [T, hidden] -> the o_proj input [T, heads*d]."""
    attn = layer.self_attn
    d = attn.head_dim
    q, k, v = _linear(x, attn.q_proj, attn.k_proj, attn.v_proj)
    q = _rotate(_heads(q, d, getattr(attn, "q_norm", None)), cos, sin)
    k = _rotate(_heads(k, d, getattr(attn, "k_norm", None)), cos, sin)
    group = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(group, 0), _heads(v, d, None).repeat_interleave(group, 0)
    scaling = float(getattr(attn, "scaling", 1 / math.sqrt(d)))
    t = x.shape[0]
    scores = exact.matmul(q, k) * scaling
    scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), -math.inf)
    weights = exact.exp(scores - scores.amax(-1, keepdim=True))
    weights = weights / exact.row_sum(weights)
    out = exact.matmul(weights, v.transpose(-1, -2))  # [heads, T, d]
    return out.transpose(0, 1).flatten(1)


def layer_forward(
    layer: nn.Module, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, Maxima]:
    """(the layer's output, its readers' input maxima) for one sequence: hidden [T, hidden],
    cos and sin [T, head_dim], all float64."""
    normed = rms_norm(hidden, layer.input_layernorm)
    qkv_max = normed.abs().amax(0)
    (attended,) = _linear(_attention(layer, normed, cos, sin), layer.self_attn.o_proj)
    hidden = hidden + attended
    normed = rms_norm(hidden, layer.post_attention_layernorm)
    mlp = layer.mlp
    gate, up = _linear(normed, mlp.gate_proj, mlp.up_proj)
    # SiLU(gate) * up; e^-gate in float32 (a maximum needs no more, and it is 3x cheaper)
    act = gate / (exact.exp((-gate).float()).double() + 1.0) * up
    (down,) = _linear(act, mlp.down_proj)
    return hidden + down, Maxima(qkv_max, normed.abs().amax(0), act.abs().amax(0))
