"""One forward pass over several sequences at once, for Llama/Qwen2-style decoders.

The rows of every sequence in the step (one token for each decoding job, a prefill chunk for
a job being admitted) go through each Linear, norm and activation together, so the weights
stream through the CPU once per step whatever the number of users; attention runs per
sequence over that sequence's own cache (inference/kvcache.py). Nothing mixes rows except the
Linears, and with per-row activation scales (inference/rowint8.py) those give a row the same
bits alone or in any batch: the answers do not depend on who else is being served.

It reuses the loaded model's own modules (embedding, norms, the possibly quantized and fused
Linears, the activation, the rotary table) and replaces only the glue of transformers'
forward: no masks for a whole padded batch, no cache objects, fewer small ops per token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from inference.kvcache import SequenceCache
from inference.rowint8 import FusedPart, RowInt8Linear

# RoPE variants whose table depends on the sequence length: not supported by a fixed table.
_LENGTH_DEPENDENT_ROPE = {"dynamic", "longrope"}


class UnsupportedModel(ValueError):
    """The model is not a plain Llama/Qwen2-style decoder this forward knows."""


@dataclass
class Segment:
    """One sequence's rows in a step: its cache and the token ids to run after it."""

    cache: SequenceCache
    ids: list[int]


class Decoder:
    def __init__(self, model, context_tokens: int):
        _check_supported(model)
        config = model.config
        body = model.model
        self.model = model
        self.embed = body.embed_tokens
        self.layers = list(body.layers)
        self.norm = body.norm
        self.lm_head = model.lm_head
        attn = self.layers[0].self_attn
        self.head_dim = attn.head_dim
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.group = self.heads // self.kv_heads
        self.scaling = attn.scaling
        self.dtype = body.norm.weight.dtype
        with torch.inference_mode():
            positions = torch.arange(context_tokens)[None]
            probe = torch.empty(0, dtype=self.dtype)
            cos, sin = body.rotary_emb(probe, positions)
        self.cos, self.sin = cos[0], sin[0]  # [context, head_dim]

    def rows_independent(self) -> bool:
        """True when every projection this forward calls is per-row int8: a row's result is
        then the same alone or beside any others (the loader falls back to torch.ao for a
        CPU or a checkpoint where per-row cannot run, and then this says so)."""
        projections = [self.lm_head]
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            projections += [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj]
            projections += [mlp.gate_proj, mlp.up_proj, mlp.down_proj]
        return all(isinstance(p, (RowInt8Linear, FusedPart)) for p in projections)

    def new_cache(self, max_tokens: int) -> SequenceCache:
        return SequenceCache(len(self.layers), self.kv_heads, self.head_dim, max_tokens, self.dtype)

    def bytes_per_token(self) -> int:
        return SequenceCache.bytes_per_token(
            len(self.layers), self.kv_heads, self.head_dim, self.dtype
        )

    @torch.inference_mode()
    def forward(self, segments: list[Segment], every_row: bool = False) -> torch.Tensor:
        """Runs every segment's ids after its cache (which grows by them) and returns the
        logits of each segment's last position, [len(segments), vocab] (with `every_row`:
        of every position, [all ids, vocab], for measuring quality)."""
        spans, positions, ids = [], [], []
        for seg in segments:
            seg.cache.reserve(len(seg.ids))
            start = len(ids)
            ids.extend(seg.ids)
            spans.append((start, len(ids)))
            positions.append(torch.arange(seg.cache.length, seg.cache.length + len(seg.ids)))
        pos = torch.cat(positions)
        cos, sin = self.cos[pos][:, None], self.sin[pos][:, None]  # [rows, 1, head_dim]
        hidden = self.embed(torch.tensor(ids, dtype=torch.long))
        for index, layer in enumerate(self.layers):
            hidden = self._layer(index, layer, hidden, cos, sin, segments, spans)
        for seg in segments:
            seg.cache.commit(len(seg.ids))
        last = hidden if every_row else hidden[[end - 1 for _, end in spans]]
        return self.lm_head(self.norm(last)).float()

    def _layer(self, index, layer, hidden, cos, sin, segments, spans) -> torch.Tensor:
        attn, mlp = layer.self_attn, layer.mlp
        x = layer.input_layernorm(hidden)
        rows = x.shape[0]
        q = _rotate(attn.q_proj(x).view(rows, self.heads, self.head_dim), cos, sin)
        k = _rotate(attn.k_proj(x).view(rows, self.kv_heads, self.head_dim), cos, sin)
        v = attn.v_proj(x).view(rows, self.kv_heads, self.head_dim)
        out = torch.empty(rows, self.heads * self.head_dim, dtype=q.dtype)
        for seg, (start, end) in zip(segments, spans, strict=True):
            keys, values = seg.cache.write(
                index, k[start:end].transpose(0, 1), v[start:end].transpose(0, 1)
            )
            out[start:end] = self._attend(q[start:end], keys, values, seg.cache.length)
        hidden = hidden + attn.o_proj(out)
        x = layer.post_attention_layernorm(hidden)
        return hidden + mlp.down_proj(mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x))

    def _attend(self, q, keys, values, past: int) -> torch.Tensor:
        """q [T, heads, dim] over keys/values [kv_heads, past + T, dim], causal. The query
        heads sharing a key head are laid out as that head's rows, so grouped-query
        attention needs no copy of the keys."""
        rows = q.shape[0]
        q = q.view(rows, self.kv_heads, self.group, self.head_dim).permute(1, 2, 0, 3)
        q = q.reshape(self.kv_heads, self.group * rows, self.head_dim)
        mask = None
        if rows > 1:  # row t sees keys up to past + t
            seen = torch.arange(past + rows)[None] <= torch.arange(past, past + rows)[:, None]
            mask = seen.repeat(self.group, 1)
        o = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=self.scaling)
        o = o.view(self.kv_heads, self.group, rows, self.head_dim).permute(2, 0, 1, 3)
        return o.reshape(rows, self.heads * self.head_dim)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding, as transformers' apply_rotary_pos_emb (rotate_half)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _check_supported(model) -> None:
    config = model.config
    body = getattr(model, "model", None)
    layers = getattr(body, "layers", None)
    if not layers or not hasattr(body, "rotary_emb") or not hasattr(model, "lm_head"):
        raise UnsupportedModel(f"{type(model).__name__} is not a Llama/Qwen2-style decoder")
    layer = layers[0]
    parts = ["input_layernorm", "post_attention_layernorm", "self_attn", "mlp"]
    if not all(hasattr(layer, p) for p in parts):
        raise UnsupportedModel(f"{type(layer).__name__} is not a Llama/Qwen2-style layer")
    if getattr(config, "use_sliding_window", False):
        raise UnsupportedModel("sliding-window attention is not supported")
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    rope_type = (rope or {}).get("rope_type") or (rope or {}).get("type")
    if rope_type in _LENGTH_DEPENDENT_ROPE:
        raise UnsupportedModel(f"rope type {rope_type!r} depends on the length")
