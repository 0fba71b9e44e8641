"""SmoothQuant-style scale folding, so that int8 dynamic activations survive outlier channels.

Dynamic int8 quantizes each activation row with one scale; a few channels that are 30-2000x
larger than the rest (small Llama/Qwen models have them) then leave the others two or three
levels. Before quantizing, each input channel j of a Linear is divided by s_j and the
weight's column j multiplied by s_j, folded into the preceding RMSNorm weight (q/k/v,
gate/up, lm_head) or into up_proj's rows (down_proj): the float model computes exactly the
same function, and the int8 one loses much less. s_j = max|x_j|^a / max|W_:,j|^(1-a), with
max|x_j| from one short calibration text, run through inference/quant/calibrate.py's forward
(the same maxima on every CPU). This module owns the arithmetic; the loader
(inference/loading/checkpoint.py) decides when to call it.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from inference.quant import exact

log = logging.getLogger("deskchat.smooth")

# Measured on SmolLM2 (KL to fp32 over 5 greedy answers): 0.76 at 0.5, 0.42 at 0.65, 0.48 at 0.8.
# With one activation scale per row (inference/quant/rowint8.py), the mean KL of the next-token
# distribution to fp32's, teacher-forced over 7 fp32 answers (219 tokens): 0.0168 at 0.5,
# 0.0181 at 0.65, 0.0417 at 0.8 (torch.ao int8 at 0.65: 0.190); through the served forward
# (inference/model/decoder.py), first tokens of 10 questions: top-1 8/10 at 0.5, 10/10 at 0.65 (the
# "capital of France" near-tie went to "L'Étoile..." at 0.5). One alpha for both paths.
ALPHA = 0.65

CALIBRATION_TEXT = (
    "You are a helpful assistant. Answer briefly.\n"
    "What is the capital of France, and how many people live there?\n"
    "用Python写一个函数，计算列表中所有偶数的和，并解释它的时间复杂度。\n"
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n"
    "Summarize the meeting notes: budget approved, launch moved to May, hire two engineers."
)

# RMSNorms that compute weight * normalized(x), so that dividing the weight divides the output.
# inference/loading/skeleton.py's RMSNorm computes as they do
PLAIN_NORMS = {"LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "MistralRMSNorm", "RMSNorm"}


def layer_groups(layer: nn.Module) -> list[tuple[nn.Module, str, list[nn.Module]]] | None:
    """(what gets divided by s, "norm" or "rows", the Linears reading it) for one decoder
    layer; None when the layer is not a known Llama-style one."""
    try:
        attn, mlp = layer.self_attn, layer.mlp
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        groups = [
            (layer.input_layernorm, "norm", [attn.q_proj, attn.k_proj, attn.v_proj]),
            (layer.post_attention_layernorm, "norm", [mlp.gate_proj, mlp.up_proj]),
            (mlp.up_proj, "rows", [mlp.down_proj]),
        ]
    except AttributeError:
        return None
    if any(type(n).__name__ not in PLAIN_NORMS for n in norms):
        return None
    return groups


def column_absmax(weight: torch.Tensor, rows: int = 8192) -> torch.Tensor:
    """max |W[:, j]| per column, a block of rows at a time (no full-size temporaries)."""
    out = torch.zeros(weight.shape[1])
    for start in range(0, weight.shape[0], rows):
        block = weight.detach()[start : start + rows].abs().amax(dim=0).float()
        torch.maximum(out, block, out=out)
    return out


def scales(act_absmax: torch.Tensor, weights: list[torch.Tensor], alpha: float = ALPHA):
    wmax = torch.stack([column_absmax(w) for w in weights]).amax(dim=0)
    return scales_from_wmax(act_absmax, wmax, alpha)


def scales_from_wmax(act_absmax: torch.Tensor, wmax: torch.Tensor, alpha: float = ALPHA):
    """s = a^alpha / w^(1 - alpha), float32, the same bits on every CPU: torch's pow is a
    different polynomial per vector width, and a scale one ulp apart rounds some weights
    to the next int8 level (inference/quant/exact.py)."""
    a = exact.log(act_absmax.double().clamp(min=1e-5))
    w = exact.log(wmax.double().clamp(min=1e-5))
    return exact.exp(a * alpha - w * (1 - alpha)).clamp(min=1e-5).float()


def divide_source(source: nn.Module, kind: str, s: torch.Tensor) -> None:
    """Divide a norm's output channels, or a Linear's output rows (and bias), by s."""
    if kind == "norm":
        source.weight.data = (source.weight.data.float() / s).to(source.weight.dtype)
        return
    source.weight.data = (source.weight.data.float() / s[:, None]).to(source.weight.dtype)
    if source.bias is not None:
        source.bias.data = (source.bias.data.float() / s).to(source.bias.dtype)


def multiply_columns(linear: nn.Linear, s: torch.Tensor) -> None:
    linear.weight.data = (linear.weight.data.float() * s).to(linear.weight.dtype)


def smooth_layer(groups, maxima: list[torch.Tensor], alpha: float = ALPHA) -> None:
    """Fold the scales of one layer's groups, from their readers' input maxima (in the
    groups' order: inference/quant/calibrate.py's Maxima)."""
    for (source, kind, linears), absmax in zip(groups, maxima, strict=True):
        s = scales(absmax, [lin.weight for lin in linears], alpha)
        divide_source(source, kind, s)
        for lin in linears:
            multiply_columns(lin, s)
