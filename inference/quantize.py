"""CPU optimisations at load time: int8 / int4 Linear layers, bf16 where native.

Quantized models are built layer by layer straight from the safetensors files: one decoder
layer's float weights exist at a time (read, calibrated, smoothed, quantized, freed), so the
peak memory stays near the size of the quantized model instead of the float one. int8 uses
the batch-invariant per-row Linear of inference/rowint8.py (fused q/k/v and gate/up) where its
self-check passes, and torch.ao's dynamic int8 Linear otherwise. It knows nothing of
tokenizers, prompts or the decode loop.
"""

from __future__ import annotations

import json
import logging
import mmap
from collections import defaultdict
from pathlib import Path

import torch
from torch import nn

from inference import heap, rope
from inference.config import DTYPE_CHOICES, QUANTIZE_CHOICES
from inference.mapped_embedding import (
    MappedEmbedding,
    dequantize_groups,
    int8_groups,
    map_tensor,
)

log = logging.getLogger("deskchat.quantize")


def native_bf16() -> bool:
    """True when oneDNN computes bf16 natively here (AVX512-BF16 or AMX), not by emulation."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def writable_executable_memory() -> bool:
    """False under MemoryDenyWriteExecute=yes (systemd) or prctl(PR_SET_MDWE): no mapping
    may be writable and executable. oneDNN's bf16 kernels are JIT-compiled into such memory
    and fail there ("could not create a primitive"); fbgemm's int8 ones map twice instead."""
    try:
        probe = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    except OSError:
        return False
    probe.close()
    return True


def compute_dtype(quantize: str, dtype: str) -> torch.dtype:
    """The dtype of activations and of the layers left unquantized.

    int8 dynamic quantization takes fp32 activations; bf16 is used only when asked for and
    the CPU has it natively (on an AVX2-only CPU it is emulated and slower than fp32).
    """
    if dtype not in DTYPE_CHOICES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}, got {dtype!r}")
    if quantize not in QUANTIZE_CHOICES:
        raise ValueError(f"quantize must be one of {', '.join(QUANTIZE_CHOICES)}, got {quantize!r}")
    if dtype == "bfloat16" and quantize == "none":
        if not native_bf16():
            log.warning("dtype bfloat16 asked for, but this CPU has no native bf16: using float32")
        elif not writable_executable_memory():
            log.warning(
                "dtype bfloat16 asked for, but writable+executable memory is denied here "
                "(MemoryDenyWriteExecute=), which oneDNN's bf16 kernels need: using float32"
            )
        else:
            return torch.bfloat16
    elif dtype == "bfloat16":
        log.warning("dtype bfloat16 is only used with quantize=none: computing in float32")
    return torch.float32


class Int8Embedding(nn.Module):
    """Token embedding stored as int8 with one scale per 64 values of a row (a quarter of
    fp32, half of bf16), handing out `out_dtype` vectors. Built from row blocks, so the float
    table never exists whole. One scale per whole row was measured too coarse: SmolLM2 then
    no longer answered "Paris" to the capital of France."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype):
        super().__init__()
        self.register_buffer("q", q)  # [rows, dim] int8
        self.register_buffer("scale", scale)  # [rows, dim / group] float32
        self.out_dtype = out_dtype

    @classmethod
    def from_blocks(cls, rows: int, blocks, out_dtype: torch.dtype) -> Int8Embedding:
        q = scale = None
        for start, block in blocks:
            block_q, block_scale = int8_groups(block)
            if q is None:
                q = torch.empty(rows, block.shape[1], dtype=torch.int8)
                scale = torch.empty(rows, block_scale.shape[1], dtype=torch.float32)
            q[start : start + block.shape[0]] = block_q
            scale[start : start + block.shape[0]] = block_scale
        return cls(q, scale, out_dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        q = nn.functional.embedding(input_ids, self.q)
        scale = nn.functional.embedding(input_ids, self.scale)
        return dequantize_groups(q, scale, self.out_dtype)


ROWS_PER_CHUNK = 4096  # float temporaries stay a few MB even for a 150k-row lm_head


def _int8_linear(
    weight: torch.Tensor, bias: torch.Tensor | None, column_scale: torch.Tensor | None = None
) -> nn.Module:
    """torch.ao dynamic int8 Linear with per-channel symmetric weights (what its
    per_channel_dynamic_qconfig observer computes), quantized a block of rows at a time.
    `column_scale` multiplies the weight's columns first (smoothing of a tied lm_head)."""
    from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear

    out_features, in_features = weight.shape
    q = torch.empty(out_features, in_features, dtype=torch.int8)
    scale = torch.empty(out_features, dtype=torch.float64)
    for start in range(0, out_features, ROWS_PER_CHUNK):
        rows = slice(start, start + ROWS_PER_CHUNK)
        w = weight.detach()[rows].to(torch.float32, copy=True)
        if column_scale is not None:
            w.mul_(column_scale)
        s = (w.abs().amax(dim=1) / 127.5).clamp(min=torch.finfo(torch.float32).eps)
        q[rows] = w.div_(s[:, None]).round_().clamp_(-128, 127).to(torch.int8)
        scale[rows] = s
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
        return _int8_linear(weight, bias, column_scale)
    if column_scale is not None:
        weight = weight.float() * column_scale
    if quantize == "int4":
        from inference.int4 import Int4Linear, fits_int4

        if fits_int4(*weight.shape):
            return Int4Linear(weight, bias)
        return _int8_linear(weight, bias)  # a shape the int4 kernel refuses
    raise ValueError(f"not a quantization: {quantize!r}")


def quantize_linears(module: nn.Module, quantize: str) -> None:
    """Replace every nn.Linear below `module` by its quantized form."""
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            setattr(module, name, quantized_linear(child.weight, child.bias, quantize))
        else:
            quantize_linears(child, quantize)


class CheckpointReader:
    """Reads named tensors from a folder's safetensors file(s) into memory of their own."""

    def __init__(self, folder: Path):
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self.where = {k: folder / f for k, f in weight_map.items()}
        else:
            from safetensors import safe_open

            single = folder / "model.safetensors"
            with safe_open(single, framework="pt") as f:
                self.where = dict.fromkeys(f.keys(), single)

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def read(self, names: list[str], dtype: torch.dtype) -> dict[str, torch.Tensor]:
        from safetensors import safe_open

        by_file = defaultdict(list)
        for name in names:
            by_file[self.where[name]].append(name)
        out = {}
        for file, keys in by_file.items():
            with safe_open(file, framework="pt") as f:  # mapped only while reading
                for key in keys:
                    out[key] = f.get_tensor(key).to(dtype, copy=True)
        return out

    def rows(self, name: str) -> int:
        from safetensors import safe_open

        with safe_open(self.where[name], framework="pt") as f:
            return f.get_slice(name).get_shape()[0]

    def row_blocks(self, name: str, rows_per_block: int, dtype: torch.dtype):
        """Yields (first row, block) with the file mapped only while each block is read, so
        the pages of a big table do not pile up in this process's RSS."""
        from safetensors import safe_open

        total = self.rows(name)
        for start in range(0, total, rows_per_block):
            with safe_open(self.where[name], framework="pt") as f:
                block = f.get_slice(name)[start : start + rows_per_block]
                block = block.to(dtype, copy=True)
            yield start, block

    def mapped_embedding(self, name: str, out_dtype: torch.dtype) -> MappedEmbedding | None:
        """The table `name` mapped from its file (inference/mapped_embedding.py), or None
        when its dtype cannot be mapped."""
        table = map_tensor(self.where[name], name)
        return None if table is None else MappedEmbedding(table, out_dtype)

    def read_prefix(self, prefix: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        names = [k for k in self.where if k.startswith(prefix)]
        return {k[len(prefix) :]: v for k, v in self.read(names, dtype).items()}


# Architectures whose decoder is plain embed -> layers -> norm, which the layer-by-layer
# build reproduces exactly (Gemma, for one, scales its embedding and is not among them).
LAYERWISE_TYPES = {"llama", "qwen2", "qwen3", "mistral"}


def _load_then_quantize(folder: Path, quantize: str, target: torch.dtype) -> nn.Module:
    """Any other architecture: load whole, then quantize its Linears (a higher peak, and no
    smoothing)."""
    from transformers import AutoModelForCausalLM

    log.warning(
        "%s: not a Llama-style decoder in safetensors; loading it whole before "
        "quantizing (a higher memory peak, no smoothing)",
        folder,
    )
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=target).eval()
    quantize_linears(model, quantize)  # lm_head is replaced, a tied embedding keeps its table
    return model


def load_quantized(
    folder: Path, quantize: str, dtype: str, calibration_ids: torch.Tensor | None = None
) -> nn.Module:
    """Build the model from `folder` with its Linears (lm_head included) quantized.

    Llama-style decoders (LAYERWISE_TYPES, safetensors weights) are built layer by layer,
    for a low memory peak; any other model is loaded whole and then quantized, without
    smoothing. For int8, `calibration_ids` turns
    on smoothing (inference/smooth.py), without which small models' outlier channels ruin the
    answers: each layer is calibrated on the float output of the layers before it.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    from inference import rowint8, smooth

    target = compute_dtype(quantize, dtype)
    per_row = quantize == "int8-row" and rowint8.available()
    config = AutoConfig.from_pretrained(folder)
    if config.model_type not in LAYERWISE_TYPES or not any(folder.glob("*.safetensors")):
        return _load_then_quantize(folder, quantize, target)
    heap.mmap_threshold(1 << 20)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=target)
    decoder = getattr(model, "model", None)
    reader = CheckpointReader(folder)
    embed_name = "model.embed_tokens.weight"
    if not (
        embed_name in reader
        and type(getattr(decoder, "embed_tokens", None)) is nn.Embedding
        and all(hasattr(decoder, a) for a in ("layers", "norm", "rotary_emb"))
        and hasattr(decoder.rotary_emb, "inv_freq")
    ):
        return _load_then_quantize(folder, quantize, target)
    embed = reader.mapped_embedding(embed_name, target)
    if embed is None:
        blocks = reader.row_blocks(embed_name, 8192, torch.bfloat16)
        embed = Int8Embedding.from_blocks(reader.rows(embed_name), blocks, target)
    decoder.embed_tokens = embed
    decoder.rotary_emb = type(decoder.rotary_emb)(config=config)  # buffers, not weights
    calibrate = quantize in ("int8", "int8-row") and calibration_ids is not None
    hidden = position = None
    if calibrate:
        hidden = embed(calibration_ids)
        cos, sin = rope.tables(decoder.rotary_emb, hidden.shape[1], hidden.dtype)
        position = cos[None], sin[None]
    for i, layer in enumerate(decoder.layers):
        layer.load_state_dict(reader.read_prefix(f"model.layers.{i}.", target), assign=True)
        groups = smooth.layer_groups(layer) if calibrate else None
        if groups:
            with (
                torch.inference_mode(),
                smooth.record_input_absmax([g[2][0] for g in groups]) as absmax,
            ):
                hidden = layer(hidden, attention_mask=None, position_embeddings=position)
            smooth.smooth_layer(groups, absmax, smooth.ALPHA)
        elif calibrate:
            log.warning("layer %d is not Llama-style: int8 without smoothing", i)
            with torch.inference_mode():
                hidden = layer(hidden, attention_mask=None, position_embeddings=position)
        if not (per_row and rowint8.quantize_decoder_layer(layer)):
            if per_row:
                log.warning("layer %d is not Llama-style: torch.ao int8, not per-row", i)
            quantize_linears(layer, quantize)
        groups = None  # it holds the layer's float Linears: they must go before the next
        heap.trim()
    decoder.norm.load_state_dict(reader.read_prefix("model.norm.", target), assign=True)
    # lm_head gets its own quantized copy (from the checkpoint's table, block by block): with
    # tied embeddings the embedding keeps its own.
    head_name = "lm_head.weight"
    if head_name not in reader or getattr(config, "tie_word_embeddings", False):
        head_name = embed_name
    head_scale = None
    if calibrate and type(decoder.norm).__name__ in smooth.PLAIN_NORMS:
        with torch.inference_mode():
            final = decoder.norm(hidden)
        absmax = final.abs().float().reshape(-1, final.shape[-1]).amax(dim=0)
        wmax = torch.zeros_like(absmax)
        for _start, block in reader.row_blocks(head_name, HEAD_ROWS_PER_PART, torch.bfloat16):
            torch.maximum(wmax, smooth.column_absmax(block), out=wmax)
            del block
        head_scale = smooth.scales_from_wmax(absmax, wmax, smooth.ALPHA)
        smooth.divide_source(decoder.norm, "norm", head_scale)
    if per_row:
        blocks = reader.row_blocks(head_name, rowint8.ROWS_PER_CHUNK, torch.bfloat16)
        model.lm_head = rowint8.RowInt8Linear.from_blocks(
            config.hidden_size, blocks, column_scale=head_scale
        )
    else:
        parts = []
        for _start, block in reader.row_blocks(head_name, HEAD_ROWS_PER_PART, torch.bfloat16):
            parts.append(quantized_linear(block, None, quantize, head_scale))
            del block
            heap.trim()
        model.lm_head = parts[0] if len(parts) == 1 else SplitLinear(parts)
    model.config.tie_word_embeddings = False
    leftovers = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if leftovers:
        raise RuntimeError(f"weights not found in the checkpoint: {', '.join(leftovers[:5])}")
    model.eval()
    heap.trim()
    heap.mmap_threshold(32 << 20)
    log.info(
        "built %s with int Linear layers (%s%s, lm_head included%s); compute in %s",
        folder.name,
        quantize,
        ", per-row activation scales, fused q/k/v and gate/up" if per_row else "",
        ", smoothed" if calibrate else "",
        str(target).removeprefix("torch."),
    )
    return model
