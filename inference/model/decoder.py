"""One forward pass over several sequences at once, for the decoder families served
(inference/model/families.py: Llama, Qwen2, Qwen3).

The rows of every sequence in the step (one token for each decoding job, a prefill chunk for
a job being admitted) go through each Linear, norm and activation together, so the weights
stream through the CPU once per step whatever the number of users; attention runs per
sequence over that sequence's own cache (inference/model/kvcache.py). Nothing mixes rows except the
Linears, and with per-row activation scales (inference/quant/rowint8.py) those give a row the same
bits alone or in any batch: the answers do not depend on who else is being served.

It reuses the loaded model's own modules (embedding, norms, the possibly quantized and fused
Linears, the activation, the rotary table) and replaces only the glue of transformers'
forward: no masks for a whole padded batch, no cache objects, fewer small ops per token.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F

from inference.model import rope
from inference.model.attention import prompt_attention
from inference.model.families import UnsupportedModel
from inference.model.kvcache import SequenceCache, SpareBuffers
from inference.quant.rowint8 import FusedPart, FusedParts, RowInt8Linear
from inference.quant.smooth import PLAIN_NORMS

# RoPE variants whose table depends on the sequence length: not supported by a fixed table.
_LENGTH_DEPENDENT_ROPE = {"dynamic", "longrope"}


@dataclass
class Segment:
    """One sequence's rows in a step: its cache and the token ids to run after it.
    `decoding`: the ids are answer tokens, a decode step's one and any drafted after it (not
    a prompt's), see Decoder._attend; forward returns the logits of each of them."""

    cache: SequenceCache
    ids: list[int]
    decoding: bool = False


@dataclass(frozen=True)
class _Fused:
    """A fused layer's parts, looked up once: at one row, each nn.Module attribute lookup
    and module call costs about what a small op does."""

    input_norm: Callable[[torch.Tensor], torch.Tensor]
    post_norm: Callable[[torch.Tensor], torch.Tensor]
    qkv: RowInt8Linear
    o_proj: RowInt8Linear
    gate_up: RowInt8Linear
    gate_up_sizes: list[int]
    down: RowInt8Linear
    act: Callable[[torch.Tensor], torch.Tensor]
    # Qwen3: each head of the fused product's queries and keys through its own norm
    qk_norm: Callable[[torch.Tensor], torch.Tensor] | None

    @classmethod
    def of(cls, layer, norm: Callable, heads: int, kv_heads: int) -> _Fused:
        attn, mlp = layer.self_attn, layer.mlp
        return cls(
            norm(layer.input_layernorm),
            norm(layer.post_attention_layernorm),
            attn.qkv_proj.linear,
            attn.o_proj,
            mlp.gate_up_proj.linear,
            mlp.gate_up_proj.sizes,
            mlp.down_proj,
            mlp.act_fn,
            _qk_norm_weight(attn, heads, kv_heads),
        )


class Decoder:
    def __init__(self, model, context_tokens: int, native=None):
        """`native`: the native library the plan chose to run each step (inference/native),
        whose int8 rows the weights were built in; None for torch's step."""
        _check_supported(model)
        config = model.config
        body = model.model
        self.model = model
        self.embed = body.embed_tokens
        self.layers = list(body.layers)
        self.lm_head = model.lm_head
        attn = self.layers[0].self_attn
        self.head_dim = attn.head_dim
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.group = self.heads // self.kv_heads
        self.scaling = attn.scaling
        self.dtype = body.norm.weight.dtype
        # One fused op per norm and per rotation where the model allows: a one-row decode
        # step pays per op dispatched (python -m bench.engine.step_profile), not per value.
        norms = [body.norm] + [n for lay in self.layers for n in _layer_norms(lay)]
        self.fused_norms = self.dtype == torch.float32 and all(
            type(n).__name__ in PLAIN_NORMS for n in norms
        )
        self.fused_projections = all(
            isinstance(getattr(lay.self_attn, "qkv_proj", None), FusedParts)
            and isinstance(getattr(lay.mlp, "gate_up_proj", None), FusedParts)
            and isinstance(lay.self_attn.o_proj, RowInt8Linear)
            and isinstance(lay.mlp.down_proj, RowInt8Linear)
            for lay in self.layers
        )
        self._final_norm = self._norm_fn(body.norm)
        self._fused = None
        if self.fused_projections:
            self._fused = [
                _Fused.of(lay, self._norm_fn, self.heads, self.kv_heads) for lay in self.layers
            ]
        cos, sin = rope.tables(body.rotary_emb, context_tokens, self.dtype)
        half = self.head_dim // 2
        self.cos = cos  # [context, head_dim]
        self.sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)  # see _rotate
        self.eps = float(body.norm.variance_epsilon) if self.fused_norms else 0.0
        self.qk_norms = hasattr(attn, "q_norm")
        self.intermediate = self._fused[0].gate_up_sizes[0] if self._fused else 0
        self._native = self._native_model(native)
        # Keys and values: float16 where the native step runs (it converts them exactly, in
        # and out, and reads half the bytes per attended position), else the compute dtype.
        self.kv_dtype = torch.float16 if self._native is not None else self.dtype
        self.spares = SpareBuffers()  # finished jobs' cache buffers, for the next ones

    def set_threads(self, threads: int) -> None:
        """The step's thread count, set from the thread that steps (the server's inference
        thread, after the load and at each change of the governor's). Where the native step
        serves it is its pool's, and torch's ops around it in this thread (sampling, the
        prefix cache's copies) run on one: a second pool (OpenMP's) woke for them beside
        the native one, and on a busy PC the first token waited for its threads
        (docs/latency.md). Else torch's step runs on `threads`. Until it is called the
        native step runs on torch's count in the calling thread (tests, benches)."""
        if self._native is not None:
            self._native.threads = threads
            torch.set_num_threads(1)
        else:
            torch.set_num_threads(threads)

    @property
    def native(self) -> str | None:
        """The native library's build level when it runs this decoder's steps, else None."""
        return self._native.lib.isa if self._native is not None else None

    def _native_model(self, native):
        """The whole step in the `native` library when the layers are plain (RMSNorm, SiLU,
        float32), else None: torch's step runs them (the loader says so)."""
        if native is None or not (self._fused and self.fused_norms):
            return None
        if any(getattr(linear, "native", None) is not native for linear in self.step_linears()):
            raise ValueError("the weights were not built for the native library the plan chose")
        if any(
            type(p.act).__name__ != "SiLUActivation" and not isinstance(p.act, torch.nn.SiLU)
            for p in self._fused
        ):
            return None
        from inference.native.library import NativeModel

        try:
            return NativeModel(native, self)
        except ValueError:
            return None

    def native_layers(self) -> list[tuple]:
        """Per layer, what the native step is given: the two norms' weights, the fused
        q/k/v, o, fused gate/up and down Linears, and the per-head query and key norms'
        weights (None without them)."""
        return [
            (lay.input_layernorm.weight, lay.post_attention_layernorm.weight, p.qkv, p.o_proj,
             p.gate_up, p.down, *_qk_norms(lay.self_attn))
            for lay, p in zip(self.layers, self._fused, strict=True)
        ]  # fmt: skip

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

    def digest(self) -> str:
        """SHA-256 of what the load computed and the step reads: every tensor of the model's
        state (int8 weights, scales, smoothed norms) and the rotary tables. Two PCs with the
        same digest and step give the same answers (a fleet's check, in /health). The
        embedding table is read from the model's file as it is, and left out: hashing it
        would page in the whole mapped table."""
        h = hashlib.sha256()
        tensors = sorted(self.model.state_dict().items())
        for name, tensor in [*tensors, ("rotary.cos", self.cos), ("rotary.sin", self.sin)]:
            if not isinstance(tensor, torch.Tensor) or tensor.is_meta:
                continue  # torch.ao's packed weights: the torch step, which has no digest
            h.update(f"{name} {tensor.dtype} {tuple(tensor.shape)}\n".encode())
            h.update(tensor.detach().contiguous().view(-1).view(torch.uint8).numpy())
        return h.hexdigest()

    def new_cache(self, capacity: int) -> SequenceCache:
        """A job's cache, its buffer from the spares (given back by `SequenceCache.release`)."""
        return SequenceCache(
            len(self.layers), self.kv_heads, self.head_dim, capacity, self.kv_dtype, self.spares
        )

    def bytes_per_token(self) -> int:
        return SequenceCache.bytes_per_token(
            len(self.layers), self.kv_heads, self.head_dim, self.kv_dtype
        )

    @torch.inference_mode()
    def forward(self, segments: list[Segment], every_row: bool = False) -> torch.Tensor:
        """Runs every segment's ids after its cache (which grows by them) and returns logits,
        in segment order: of a prompt segment's last position, of every position of a
        decoding segment ([rows, vocab]; one row per segment when none has drafts). With
        `every_row`: of every position of every segment, for measuring quality."""
        spans, positions, ids, out = [], [], [], []
        for seg in segments:
            seg.cache.reserve(len(seg.ids))
            start = len(ids)
            ids.extend(seg.ids)
            spans.append((start, len(ids)))
            positions.append(torch.arange(seg.cache.length, seg.cache.length + len(seg.ids)))
            out.extend(range(start, len(ids)) if seg.decoding else [len(ids) - 1])
        pos = torch.cat(positions)
        hidden = self.embed(torch.tensor(ids, dtype=torch.long))
        if self._native is not None:
            caches = [seg.cache for seg in segments for _ in seg.ids]
            rows = range(len(ids)) if every_row else out
            logits = self._native.forward(hidden.float().contiguous(), pos, caches, rows)
            for seg in segments:
                seg.cache.commit(len(seg.ids))
            return logits
        cos, sin = self.cos[pos][:, None], self.sin[pos][:, None]  # [rows, 1, head_dim]
        if self._fused is not None:
            for index, parts in enumerate(self._fused):
                hidden = self._fused_layer(index, parts, hidden, cos, sin, segments, spans)
        else:
            for index, layer in enumerate(self.layers):
                hidden = self._layer(index, layer, hidden, cos, sin, segments, spans)
        for seg in segments:
            seg.cache.commit(len(seg.ids))
        last = hidden if every_row else hidden[out]
        return self.lm_head(self._final_norm(last)).float()

    def step_linears(self) -> list[RowInt8Linear]:
        """The per-row int8 Linears a one-row step multiplies by, in order (none unless the
        projections are fused): what bench.engine.gemm_floor times alone."""
        if self._fused is None:
            return []
        parts = [(p.qkv, p.o_proj, p.gate_up, p.down) for p in self._fused]
        return [linear for layer in parts for linear in layer] + [self.lm_head]

    def _norm_fn(self, module) -> Callable[[torch.Tensor], torch.Tensor]:
        """The norm as one fused op where the model allows, else the module itself."""
        if self.fused_norms:
            weight, eps = module.weight, module.variance_epsilon
            return partial(F.rms_norm, normalized_shape=weight.shape, weight=weight, eps=eps)
        return module

    def _norm(self, module, x: torch.Tensor) -> torch.Tensor:
        return self._norm_fn(module)(x)

    def _qkv(self, attn, x: torch.Tensor, cos, sin) -> tuple[torch.Tensor, ...]:
        """Rotated queries and keys (each head normed first where the family does), and
        values, [rows, heads, dim] each, from three products (the fused product is
        _split_qkv's)."""
        rows = x.shape[0]
        q = attn.q_proj(x).view(rows, self.heads, self.head_dim)
        k = attn.k_proj(x).view(rows, self.kv_heads, self.head_dim)
        if self.qk_norms:
            q, k = attn.q_norm(q), attn.k_norm(k)
        v = attn.v_proj(x).view(rows, self.kv_heads, self.head_dim)
        return _rotate(q, cos, sin), _rotate(k, cos, sin), v

    def _split_qkv(self, qkv: torch.Tensor, cos, sin, qk_norm=None) -> tuple[torch.Tensor, ...]:
        """The fused product's queries and keys, each head normed by its row of `qk_norm`
        where the family does, rotated together (adjacent in it), and its values."""
        rows = qkv.shape[0]
        qk_width = (self.heads + self.kv_heads) * self.head_dim
        qk = qkv[:, :qk_width].view(rows, self.heads + self.kv_heads, self.head_dim)
        if qk_norm is not None:
            qk = qk_norm(qk)
        qk = _rotate(qk, cos, sin)
        v = qkv[:, qk_width:].view(rows, self.kv_heads, self.head_dim)
        return qk[:, : self.heads], qk[:, self.heads :], v

    def _mlp(self, mlp, x: torch.Tensor) -> torch.Tensor:
        return mlp.down_proj(mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x))

    def _layer(self, index, layer, hidden, cos, sin, segments, spans) -> torch.Tensor:
        attn = layer.self_attn
        q, k, v = self._qkv(attn, self._norm(layer.input_layernorm, hidden), cos, sin)
        hidden = hidden + attn.o_proj(self._attention(index, q, k, v, segments, spans))
        return hidden + self._mlp(layer.mlp, self._norm(layer.post_attention_layernorm, hidden))

    def _fused_layer(self, index, parts: _Fused, hidden, cos, sin, segments, spans):
        """_layer with fused projections, from the parts looked up at load."""
        qkv = parts.qkv.rows(parts.input_norm(hidden))
        q, k, v = self._split_qkv(qkv, cos, sin, parts.qk_norm)
        hidden = hidden + parts.o_proj.rows(self._attention(index, q, k, v, segments, spans))
        gate, up = parts.gate_up.rows(parts.post_norm(hidden)).split(parts.gate_up_sizes, dim=-1)
        h = parts.act(gate).mul_(up)
        del gate, up  # the fused product (the step's largest) is freed before down_proj
        return hidden + parts.down.rows(h)

    def _attention(self, index, q, k, v, segments, spans) -> torch.Tensor:
        """Each segment's rows over its own cache, which takes their keys and values."""
        parts = []
        for seg, (start, end) in zip(segments, spans, strict=True):
            keys, values = seg.cache.write(
                index, k[start:end].transpose(0, 1), v[start:end].transpose(0, 1)
            )
            parts.append(self._attend(q[start:end], keys, values, seg.cache.length, seg.decoding))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _attend(self, q, keys, values, past: int, decoding: bool = False) -> torch.Tensor:
        """q [T, heads, dim] over keys/values [kv_heads, past + T, dim], causal. The query
        heads sharing a key head are laid out as that head's rows, so grouped-query
        attention needs no copy of the keys.

        A decode step's row goes in 4-D to torch's fused CPU kernel (27 vs 67 us a layer
        for the math path). Drafted rows after it (inference/runtime/schedule.py) go one
        by one through the same call over the keys up to their own position, so a token
        verified in a draft has the bits it would have had in a step of its own. Prompt
        rows, a last chunk of one row too, go through prompt_attention's fixed key blocks:
        the engine chunks a prompt by the load, and torch's kernels' blocking (so their
        rounding) follows the number of rows and keys."""
        if decoding:  # one view per layer and token: at one row each op costs its dispatch
            width = self.heads * self.head_dim
            if q.shape[0] == 1:
                return self._attend_one(q, keys, values).reshape(1, width)
            rows = [
                self._attend_one(q[t : t + 1], keys[:, : past + t + 1], values[:, : past + t + 1])
                for t in range(q.shape[0])
            ]
            return torch.cat(rows).reshape(q.shape[0], width)
        q = q.view(q.shape[0], self.kv_heads, self.group, self.head_dim)
        return prompt_attention(q, keys, values, past, self.scaling)

    def _attend_one(self, q, keys, values) -> torch.Tensor:
        """One answer row over keys/values [kv_heads, n, dim]: the fused kernel, 4-D."""
        q = q.view(1, self.kv_heads, self.group, self.head_dim)
        return F.scaled_dot_product_attention(q, keys[None], values[None], scale=self.scaling)


def _layer_norms(layer) -> list:
    return [layer.input_layernorm, layer.post_attention_layernorm, *_qk_norm_modules(layer)]


def _qk_norm_modules(layer) -> list:
    attn = layer.self_attn
    return [attn.q_norm, attn.k_norm] if hasattr(attn, "q_norm") else []


def _qk_norms(attn) -> tuple:
    """The per-head query and key norms' weights, or (None, None)."""
    if not hasattr(attn, "q_norm"):
        return None, None
    return attn.q_norm.weight, attn.k_norm.weight


def _qk_norm_weight(attn, heads: int, kv_heads: int) -> Callable | None:
    """The norm of the fused product's query and key heads side by side: each head's RMS,
    then the query heads' weight or the key heads' (a row per head)."""
    q_norm, k_norm = _qk_norms(attn)
    if q_norm is None:
        return None
    weight = torch.cat([q_norm.expand(heads, -1), k_norm.expand(kv_heads, -1)]).detach()
    eps = attn.q_norm.variance_epsilon

    def norm(qk: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(qk.float(), (weight.shape[-1],), eps=eps).to(qk.dtype) * weight

    return norm


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding, as transformers' apply_rotary_pos_emb: its rotate_half(x)
    is [-x2, x1]; here the halves are swapped by one roll and the sign sits in `signed_sin`
    ([-sin1, sin2], made once), the same products in 4 ops instead of 7."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * signed_sin


def _check_supported(model) -> None:
    config = model.config
    body = getattr(model, "model", None)
    layers = getattr(body, "layers", None)
    rotary = getattr(body, "rotary_emb", None)
    if not layers or not hasattr(rotary, "inv_freq") or not hasattr(model, "lm_head"):
        raise UnsupportedModel(f"{type(model).__name__} is not a Llama/Qwen2-style decoder")
    layer = layers[0]
    parts = ["input_layernorm", "post_attention_layernorm", "self_attn", "mlp"]
    if not all(hasattr(layer, p) for p in parts):
        raise UnsupportedModel(f"{type(layer).__name__} is not a Llama/Qwen2-style layer")
    if hasattr(layer.self_attn, "q_norm") != hasattr(layer.self_attn, "k_norm"):
        raise UnsupportedModel("a norm over the query heads or the key heads alone")
    if getattr(config, "use_sliding_window", False):
        raise UnsupportedModel("sliding-window attention is not supported")
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    rope_type = (params or {}).get("rope_type") or (params or {}).get("type")
    if rope_type in _LENGTH_DEPENDENT_ROPE:
        raise UnsupportedModel(f"rope type {rope_type!r} depends on the length")
