"""Building a quantized model from its checkpoint: int8 / int4 Linear layers, layer by layer.

Quantized models are built layer by layer straight from the safetensors files: one decoder
layer's float weights exist at a time (read, calibrated, smoothed, quantized, freed), so the
peak memory stays near the size of the quantized model instead of the float one. int8 uses
the batch-invariant per-row Linear of inference/quant/rowint8.py (fused q/k/v and gate/up) where its
self-check passes, and torch.ao's dynamic int8 Linear otherwise. It knows nothing of
tokenizers, prompts or the decode loop.
"""

from __future__ import annotations

import json
import logging
from collections import defaultdict
from pathlib import Path

import torch
from torch import nn

from inference.host import heap
from inference.host.cpu import compute_dtype
from inference.model import rope
from inference.quant import torchao
from inference.quant.embedding import Int8Embedding, MappedEmbedding, map_tensor
from inference.quant.torchao import HEAD_ROWS_PER_PART

log = logging.getLogger("deskchat.checkpoint")


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
        """The table `name` mapped from its file (inference/quant/embedding.py), or None
        when its dtype cannot be mapped."""
        table = map_tensor(self.where[name], name)
        return None if table is None else MappedEmbedding(table, out_dtype)

    def read_prefix(self, prefix: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        names = [k for k in self.where if k.startswith(prefix)]
        return {k[len(prefix) :]: v for k, v in self.read(names, dtype).items()}


# What smoothing (inference/quant/smooth.py) applies to. Not int4-row: it moves the
# activations' outliers into the weights, which 4 bits keep worst (embedded model, `python -m
# bench.quality --quantize int4-row`: mean KL to fp32 0.195 smoothed, 0.0535 not). Its lm_head
# stays int8 too (0.126 with a 4-bit one; llama.cpp's Q4_K_M keeps its output at 6 bits).
SMOOTHED = ("int8", "int8-row")

# Architectures whose decoder is plain embed -> layers -> norm, which the layer-by-layer
# build reproduces exactly (Gemma, for one, scales its embedding and is not among them).
LAYERWISE_TYPES = {"llama", "qwen2", "qwen3", "mistral"}


def layerwise(folder: Path, config) -> bool:
    """Whether `folder`'s model is built layer by layer (load_quantized): a Llama-style
    decoder in safetensors. int4-row takes only these (auto's rule asks too)."""
    return config.model_type in LAYERWISE_TYPES and any(folder.glob("*.safetensors"))


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
    torchao.quantize_linears(
        model, quantize
    )  # lm_head is replaced, a tied embedding keeps its table
    return model


@torch.no_grad()  # the loaded Parameters want grads: a scale made from them kept a graph
def load_quantized(
    folder: Path,
    quantize: str,
    dtype: str,
    calibration_ids: torch.Tensor | None = None,
    native=None,
    hf_forward: bool = True,
) -> nn.Module:
    """Build the model from `folder` with its Linears (lm_head included) quantized.

    Llama-style decoders (LAYERWISE_TYPES, safetensors weights) are built layer by layer,
    for a low memory peak; any other model is loaded whole and then quantized, without
    smoothing. `native` (an inference/native Library) keeps int8-row weights for it
    instead of fbgemm's packs; int4-row (inference/quant/rowint4.py) needs it. For int8,
    `calibration_ids` turns
    on smoothing (inference/quant/smooth.py), without which small models' outlier channels ruin the
    answers: each layer is calibrated on the float output of the layers before it.
    Without `hf_forward` a plain Llama/Qwen2 gets the tree of inference/loading/skeleton.py,
    which only inference/model/decoder.py runs (no forward, no generate) and which spares
    the server transformers' modeling imports (87 MB).
    """
    from transformers import AutoConfig

    from inference.loading import skeleton
    from inference.quant import calibrate as calibrate_forward
    from inference.quant import rowint4, rowint8, smooth

    target = compute_dtype(quantize, dtype)
    four_bit = quantize == "int4-row"
    if four_bit and native is None:
        raise ValueError("int4-row needs the native decode step (inference/native)")
    per_row = four_bit or (quantize == "int8-row" and (native is not None or rowint8.available()))
    kind = rowint4.RowInt4Linear if four_bit else rowint8.RowInt8Linear
    config = AutoConfig.from_pretrained(folder)
    by_layer = layerwise(folder, config)
    if four_bit and not by_layer:
        raise ValueError(f"{folder.name}: int4-row takes Llama-style decoders in safetensors")
    if not by_layer:
        return _load_then_quantize(folder, quantize, target)
    heap.mmap_threshold(1 << 20)
    model = None if hf_forward else skeleton.empty_model(config, target)
    if model is None:  # transformers' own tree
        from transformers import AutoModelForCausalLM

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
        if four_bit:
            raise ValueError(f"{folder.name}: int4-row takes Llama-style decoders only")
        return _load_then_quantize(folder, quantize, target)
    embed = reader.mapped_embedding(embed_name, target)
    if embed is None:
        blocks = reader.row_blocks(embed_name, 8192, torch.bfloat16)
        embed = Int8Embedding.from_blocks(reader.rows(embed_name), blocks, target)
    decoder.embed_tokens = embed
    decoder.rotary_emb = type(decoder.rotary_emb)(config=config)  # buffers, not weights
    calibrate = quantize in SMOOTHED and calibration_ids is not None
    if calibrate and not all(
        smooth.layer_groups(lay) and calibrate_forward.supported(lay) for lay in decoder.layers
    ):
        log.warning("%s: not a plain Llama-style decoder: int8 without smoothing", folder.name)
        calibrate = False
    hidden = cos = sin = None
    if calibrate:  # one sequence, float64, on CPU-independent operations
        hidden = embed(calibration_ids)[0].double()
        cos, sin = rope.tables(decoder.rotary_emb, hidden.shape[0], torch.float32)
        cos, sin = cos.double(), sin.double()
    for i, layer in enumerate(decoder.layers):
        layer.load_state_dict(reader.read_prefix(f"model.layers.{i}.", target), assign=True)
        if calibrate:
            # Its float64 temporaries (up to ~20 MB) from the heap, not from fresh mmaps
            # that fault in every page (2.4x slower on the Qwen shape); trimmed below.
            heap.mmap_threshold(32 << 20)
            with torch.inference_mode():
                hidden, maxima = calibrate_forward.layer_forward(layer, hidden, cos, sin)
            heap.mmap_threshold(1 << 20)
            heap.trim()  # those temporaries (~80 MB on the Qwen shape) go before quantizing
            groups = smooth.layer_groups(layer)
            smooth.smooth_layer(groups, [maxima.qkv, maxima.gate_up, maxima.down])
        if not (per_row and rowint8.quantize_decoder_layer(layer, native, kind)):
            if four_bit:
                raise ValueError(f"layer {i} is not Llama-style: no int4-row for it")
            if per_row:
                log.warning("layer %d is not Llama-style: torch.ao int8, not per-row", i)
            torchao.quantize_linears(layer, quantize)
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
        absmax = calibrate_forward.rms_norm(hidden, decoder.norm).abs().amax(0)
        wmax = torch.zeros_like(absmax)
        for _start, block in reader.row_blocks(head_name, HEAD_ROWS_PER_PART, torch.bfloat16):
            torch.maximum(wmax, smooth.column_absmax(block), out=wmax)
            del block
        head_scale = smooth.scales_from_wmax(absmax, wmax, smooth.ALPHA)
        smooth.divide_source(decoder.norm, "norm", head_scale)
    if per_row:
        blocks = reader.row_blocks(head_name, rowint8.ROWS_PER_CHUNK, torch.bfloat16)
        model.lm_head = rowint8.RowInt8Linear.from_blocks(
            config.hidden_size,
            blocks,
            column_scale=head_scale,
            native=native,
            out_features=reader.rows(head_name),
        )
    else:
        parts = []
        for _start, block in reader.row_blocks(head_name, HEAD_ROWS_PER_PART, torch.bfloat16):
            parts.append(torchao.quantized_linear(block, None, quantize, head_scale))
            del block
            heap.trim()
        model.lm_head = parts[0] if len(parts) == 1 else torchao.SplitLinear(parts)
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
