"""One sequence's key/value cache: every layer's keys and values in one tensor that grows.

Each running job owns one, so a job that leaves the batch frees exactly its own memory and
the others' caches are never copied, padded or re-laid out. The buffer grows by doubling (a
copy per doubling, amortized), in steps of GROW_TOKENS, never past the job's own capacity
(its prompt plus the most answer tokens its budget allows: inference/runtime/budget.py).

A finished job's buffer may go to the engine's spares (SpareBuffers) for the next job: its
pages are then already the process's. A fresh buffer's pages fault in as the job first
writes them, ~1.9 us a page on a 2-core build VM (2026-12-03): a 601-token conversation
restored from the prefix cache took 6.5 ms to copy into a fresh buffer (3,487 page faults),
2.5 ms into a reused one (none), on the way to its first token.
"""

from __future__ import annotations

import torch

from inference.host import heap

GROW_TOKENS = 256  # allocations are multiples of this; short answers never grow at all


class SpareBuffers:
    """Finished jobs' cache buffers, kept for the jobs that follow while the server is busy.

    Buffers are flat and sized by powers of two in bytes (a buffer's untouched end costs
    address space, not RSS), and a need takes only a buffer of its own size class: a job
    holds at most twice its room, and a conversation's next question, a little longer than
    the last, still fits the last one's buffer. When none fits, every kept buffer is let go
    before a fresh one is made, so idle spares never sit beside a new allocation. The worker
    lets them all go when it has been idle a while (`clear`); while the PC is short of memory
    none is kept and a need lets the kept ones go."""

    def __init__(self, memory_is_short=heap.memory_is_short):
        self._kept: list[torch.Tensor] = []
        self._memory_is_short = memory_is_short

    def __len__(self) -> int:
        return len(self._kept)

    @property
    def buffers(self) -> tuple[torch.Tensor, ...]:
        return tuple(self._kept)

    def take(self, numel: int, dtype) -> torch.Tensor:
        """A flat buffer of at least `numel` elements: a kept one of the size class, else new."""
        if self._kept and self._memory_is_short():
            self.clear()
        size = _size_class(numel * dtype.itemsize)
        for i, kept in enumerate(self._kept):
            if kept.dtype == dtype and kept.numel() * kept.element_size() == size:
                return self._kept.pop(i)
        self.clear()
        # A normal tensor, also when a step (in inference mode) grows a cache: a later job
        # may take it outside inference mode, where an inference tensor cannot be written.
        with torch.inference_mode(False):
            return torch.empty(size // dtype.itemsize, dtype=dtype)

    def give(self, buffer: torch.Tensor) -> None:
        """Keep a finished job's flat buffer (from `take`) for a later one."""
        if not self._memory_is_short():
            self._kept.append(buffer)

    def clear(self) -> None:
        self._kept.clear()


def _size_class(nbytes: int) -> int:
    return 1 << max(nbytes - 1, 0).bit_length()


class SequenceCache:
    def __init__(
        self,
        layers: int,
        kv_heads: int,
        head_dim: int,
        capacity: int,
        dtype,
        spares: SpareBuffers | None = None,
    ):
        """`spares`: where the buffer comes from and goes back to (`release`); without,
        each buffer is allocated for itself and freed with the cache."""
        self.capacity = capacity  # positions this job may ever fill: prompt + answer budget
        self.length = 0  # positions filled (the same in every layer once a forward is done)
        self._shape = (layers, 2, kv_heads, 0, head_dim)
        self._dtype = dtype
        self._buf = torch.empty(self._shape, dtype=dtype)
        self._spares = spares
        self._flat: torch.Tensor | None = None  # the spares' buffer that _buf lies in

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
        shape = (layers, 2, heads, grown, dim)
        if self._spares is None:
            buf = torch.empty(shape, dtype=self._dtype)
        else:  # the outgrown buffer is freed, not kept: the spares hold finished jobs' only
            flat = self._spares.take(layers * 2 * heads * grown * dim, self._dtype)
            buf = flat[: layers * 2 * heads * grown * dim].view(shape)
            self._flat = flat
        buf[:, :, :, : self.length] = self._buf[:, :, :, : self.length]
        self._buf = buf

    def release(self) -> None:
        """The job is done with it: its buffer goes to the spares, if it came from them."""
        if self._spares is not None and self._flat is not None:
            self._spares.give(self._flat)
        self._flat = None
        self._buf = torch.empty(self._shape, dtype=self._dtype)
        self.length = 0

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
