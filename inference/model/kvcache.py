"""One sequence's key/value cache: every layer's keys and values in one tensor that grows.

Each running job owns one, so a job that leaves the batch frees exactly its own memory and
the others' caches are never copied, padded or re-laid out. The buffer grows by doubling (a
copy per doubling, amortized), in steps of GROW_TOKENS, never past the job's own capacity
(its prompt plus the most answer tokens its budget allows: inference/runtime/budget.py).
"""

from __future__ import annotations

import torch

GROW_TOKENS = 256  # allocations are multiples of this; short answers never grow at all


class SequenceCache:
    def __init__(self, layers: int, kv_heads: int, head_dim: int, capacity: int, dtype):
        self.capacity = capacity  # positions this job may ever fill: prompt + answer budget
        self.length = 0  # positions filled (the same in every layer once a forward is done)
        self._shape = (layers, 2, kv_heads, 0, head_dim)
        self._dtype = dtype
        self._buf = torch.empty(self._shape, dtype=dtype)

    @staticmethod
    def bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype) -> int:
        return layers * 2 * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    @property
    def allocated(self) -> int:
        """Positions the buffer has room for now (grows up to `capacity`)."""
        return self._buf.shape[3]

    @property
    def nbytes(self) -> int:
        return self._buf.numel() * self._buf.element_size()

    def buffer(self) -> torch.Tensor:
        """The whole [layers, 2, kv_heads, allocated, head_dim] buffer (the native step
        writes and reads it in place)."""
        return self._buf

    def reserve(self, tokens: int) -> None:
        """Room for `tokens` more positions (called once per forward, before any layer)."""
        need = self.length + tokens
        if need > self.capacity:
            raise ValueError(f"cache capacity {self.capacity} exceeded ({need} positions)")
        if need <= self.allocated:
            return
        grown = max(need, 2 * self.allocated, GROW_TOKENS)
        grown = min(-(-grown // GROW_TOKENS) * GROW_TOKENS, self.capacity)
        layers, _, heads, _, dim = self._shape
        buf = torch.empty((layers, 2, heads, grown, dim), dtype=self._dtype)
        buf[:, :, :, : self.length] = self._buf[:, :, :, : self.length]
        self._buf = buf

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple:
        """Store [kv_heads, T, head_dim] keys and values after the filled positions; returns
        this layer's keys and values up to and including them. `commit(T)` after the last
        layer moves `length` on."""
        end = self.length + keys.shape[1]
        self._buf[layer, 0, :, self.length : end] = keys
        self._buf[layer, 1, :, self.length : end] = values
        return self._buf[layer, 0, :, :end], self._buf[layer, 1, :, :end]

    def commit(self, tokens: int) -> None:
        self.length += tokens

    def crop(self, length: int) -> None:
        """Forget every position from `length` on (reuse of a shared prompt prefix)."""
        self.length = min(self.length, length)
