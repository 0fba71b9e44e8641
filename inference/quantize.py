"""CPU optimisations applied to a loaded model: int8 / int4 Linear layers, bf16 where native.

Owns the choice of load dtype (bf16 when the Linear layers get quantized anyway, so the fp32
copy of the model never exists in memory) and the in-place module surgery that follows. It
knows nothing of tokenizers, prompts or the decode loop.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from inference.config import DTYPE_CHOICES, QUANTIZE_CHOICES

log = logging.getLogger("deskchat.quantize")


def native_bf16() -> bool:
    """True when oneDNN computes bf16 natively here (AVX512-BF16 or AMX), not by emulation."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def compute_dtype(quantize: str, dtype: str) -> torch.dtype:
    """The dtype of activations and of the layers left unquantized.

    int8 dynamic quantization takes fp32 activations; bf16 is used only when asked for and
    the CPU has it natively (on an AVX2-only CPU it is emulated and slower than fp32).
    """
    if dtype not in DTYPE_CHOICES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}, got {dtype!r}")
    if quantize not in QUANTIZE_CHOICES:
        raise ValueError(f"quantize must be one of {', '.join(QUANTIZE_CHOICES)}, got {quantize!r}")
    if dtype == "bfloat16" and quantize != "int8":
        if native_bf16():
            return torch.bfloat16
        log.warning("dtype bfloat16 asked for, but this CPU has no native bf16: using float32")
    elif dtype == "bfloat16":
        log.warning("dtype bfloat16 does not combine with int8 dynamic quantization: float32")
    return torch.float32


def load_dtype(quantize: str, dtype: str) -> torch.dtype:
    """Load quantized models in bf16: half the peak memory of fp32, and lossless for
    checkpoints stored in bf16 (as Qwen2.5's are)."""
    return torch.bfloat16 if quantize != "none" else compute_dtype(quantize, dtype)


class BF16Embedding(nn.Module):
    """Token embedding stored in bf16 (half the memory), handing out `out_dtype` vectors."""

    def __init__(self, weight: torch.Tensor, out_dtype: torch.dtype, padding_idx: int | None):
        super().__init__()
        self.register_buffer("weight", weight.detach().to(torch.bfloat16))
        self.out_dtype = out_dtype
        self.padding_idx = padding_idx

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return nn.functional.embedding(input_ids, self.weight).to(self.out_dtype)


def _int8_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Module:
    """torch.ao dynamic int8 Linear, per-channel symmetric weights, from any-dtype weights."""
    from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear
    from torch.ao.quantization import per_channel_dynamic_qconfig

    out_features, in_features = weight.shape
    staging = nn.Linear(in_features, out_features, bias=bias is not None, device="meta")
    staging.weight = nn.Parameter(weight.detach().float(), requires_grad=False)
    if bias is not None:
        staging.bias = nn.Parameter(bias.detach().float(), requires_grad=False)
    staging.qconfig = per_channel_dynamic_qconfig
    return DynamicLinear.from_float(staging)


def _quantized(weight: torch.Tensor, bias: torch.Tensor | None, quantize: str) -> nn.Module:
    if quantize == "int8":
        return _int8_linear(weight, bias)
    from inference.int4 import Int4Linear

    return Int4Linear(weight, bias)


def _replace_linears(module: nn.Module, quantize: str, skip: set[int]) -> int:
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear) and id(child) not in skip:
            setattr(module, name, _quantized(child.weight, child.bias, quantize))
            child.weight = None  # drop the float weight now: keeps the peak low
            count += 1
        else:
            count += _replace_linears(child, quantize, skip)
    return count


def optimize_model(
    model: nn.Module, quantize: str, dtype: str, calibration_ids: torch.Tensor | None = None
) -> nn.Module:
    """Quantize the Linear layers (lm_head included) in place; return the model, ready.

    For int8, `calibration_ids` (one short tokenized text) turns on smoothing
    (inference/smooth.py), without which small models' outlier channels ruin the answers.
    """
    from inference.int4 import Int4Linear
    from inference.smooth import smooth_model

    target = compute_dtype(quantize, dtype)
    if quantize == "none":
        return model.to(target)
    embed = model.get_input_embeddings()
    head = model.get_output_embeddings()
    head_scale = None
    if quantize == "int8" and calibration_ids is not None:
        head_scale = smooth_model(model, calibration_ids)
    # The decoder's Linears, one at a time: each float weight is freed once quantized.
    replaced = _replace_linears(
        model.model if hasattr(model, "model") else model,
        quantize,
        skip={id(head)} if head is not None else set(),
    )
    if head is not None:
        # lm_head gets its own quantized copy: with tied embeddings the embedding must keep
        # its float table, so the two are untied here rather than quantized together.
        weight = head.weight if head_scale is None else head.weight.float() * head_scale
        model.lm_head = _quantized(weight, getattr(head, "bias", None), quantize)
        del weight
        replaced += 1
        model.config.tie_word_embeddings = False
        if hasattr(model.config, "get_text_config"):
            model.config.get_text_config().tie_word_embeddings = False
    model.set_input_embeddings(BF16Embedding(embed.weight, target, embed.padding_idx))
    # What is left (norms, rotary tables) is small: bring it to the compute dtype.
    for module in model.modules():
        if isinstance(module, BF16Embedding | Int4Linear):
            continue  # these keep their own storage dtypes
        for name, param in list(module.named_parameters(recurse=False)):
            if param is not None and param.is_floating_point() and param.dtype != target:
                setattr(module, name, nn.Parameter(param.detach().to(target), requires_grad=False))
        for name, buf in list(module.named_buffers(recurse=False)):
            if buf is not None and buf.is_floating_point() and buf.dtype != target:
                module._buffers[name] = buf.to(target)
    model.config.dtype = target
    log.info(
        "quantized %d Linear layers to %s (lm_head included); compute in %s",
        replaced,
        quantize,
        str(target).removeprefix("torch."),
    )
    return model
