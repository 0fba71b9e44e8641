"""Prompt prefixes' keys and values, shared by every request: what a repeated system prompt,
tool list or conversation history costs is paid once.

A prompt is cut into blocks of a few tokens (16 on per-row weights); each block is found by
a hash chain (its hash covers its tokens and every block before it, so equal hashes mean
equal prefixes, as vLLM's automatic prefix caching does). A block holds the keys and values
of its positions in every layer, a copy taken from a finished job's cache. A new job copies
the longest chain found into its own cache and computes only the rest; its blocks are kept
when it closes.

On per-row weights (the native step's) a row's keys and values do not depend on the rows
computed beside it, so a copied prefix holds the bits a fresh prefill would, answer rows
included. Elsewhere they depend on the chunking: the engine then keeps only prompt rows,
prefilled in fixed chunks that a block's end always falls on. Either way an answer is
identical with or without the cache. Blocks are kept by recency within a byte budget, and
all of them are given back when the PC runs short of memory (`MemAvailable`).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import torch

from inference.model.kvcache import SequenceCache

BLOCK = 16  # tokens per block, by default: the engine's chunk alignment on per-row weights
# Below this share of MemTotal available, the cache lets go of every block it holds.
LOW_MEMORY_SHARE = 0.10


def _chain(prompt_ids: list[int], blocks: int, block: int) -> list[bytes]:
    """The hash of each of the first `blocks` blocks, each covering all blocks before it."""
    hashes, previous = [], b""
    for i in range(blocks):
        chunk = prompt_ids[i * block : (i + 1) * block]
        digest = hashlib.blake2b(previous, digest_size=16)
        digest.update(b"".join(t.to_bytes(4, "little") for t in chunk))
        previous = digest.digest()
        hashes.append(previous)
    return hashes


def memory_is_short() -> bool:
    """True when the available memory is under LOW_MEMORY_SHARE of the PC's RAM."""
    import psutil

    memory = psutil.virtual_memory()
    return memory.available < LOW_MEMORY_SHARE * memory.total


class PrefixCache:
    """Blocks of keys and values by prefix hash, least recently used first out."""

    def __init__(self, budget_bytes: int, block: int = BLOCK, memory_is_short=memory_is_short):
        """`block`: tokens per block, a multiple of the engine's prefill chunk alignment (a
        restored prefix must end where a fresh prefill's chunk would)."""
        self.budget_bytes = budget_bytes
        self.block = block
        self.bytes = 0
        self.hits = self.misses = 0  # prompt tokens taken from the cache / computed
        self._blocks: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self._memory_is_short = memory_is_short

    def __len__(self) -> int:
        return len(self._blocks)

    def _found(self, prompt_ids: list[int]) -> list[tuple[bytes, torch.Tensor]]:
        """The cached blocks of the longest cached prefix of `prompt_ids`, never its last
        token (whose forward gives the first answer token's logits)."""
        found = []
        for key in _chain(prompt_ids, (len(prompt_ids) - 1) // self.block, self.block):
            block = self._blocks.get(key)
            if block is None:
                break
            found.append((key, block))
        return found

    def cached_tokens(self, prompt_ids: list[int]) -> int:
        """How many prompt tokens `restore` would take from the cache now: admission's
        estimate counts only the rest (web/relay.py). Called from request threads while the
        inference thread keeps and drops blocks: single dict lookups (atomic under CPython's
        GIL; a free-threaded build would need a lock), recency untouched. Blocks may go
        before the job starts; it is an estimate."""
        return len(self._found(prompt_ids)) * self.block

    def restore(self, prompt_ids: list[int], cache: SequenceCache) -> int:
        """Copy the longest cached prefix of `prompt_ids` into the empty `cache`; returns its
        length in tokens. The last prompt token is always left to compute."""
        size = self.block
        found = self._found(prompt_ids)
        for key, _ in reversed(found):  # a prefix is used at least as recently as its ends
            self._blocks.move_to_end(key)
        tokens = len(found) * size
        if tokens:
            cache.reserve(tokens)
            buffer = cache.buffer()
            for i, (_, block) in enumerate(found):
                buffer[:, :, :, i * size : (i + 1) * size] = block
            cache.commit(tokens)
        self.hits += tokens
        self.misses += len(prompt_ids) - tokens
        return tokens

    def keep(self, prompt_ids: list[int], cache: SequenceCache) -> None:
        """Keep the whole blocks of `prompt_ids` that `cache` holds and this cache lacks."""
        if self._memory_is_short():
            self.clear()
            return
        size = self.block
        blocks = min(len(prompt_ids), cache.length) // size
        buffer = cache.buffer()
        nbytes = buffer[:, :, :, :size].numel() * buffer.element_size()  # every block's size
        if blocks == 0 or nbytes > self.budget_bytes:
            return
        chain = _chain(prompt_ids, blocks, size)
        for i, key in enumerate(chain):
            if key not in self._blocks:
                self._blocks[key] = buffer[:, :, :, i * size : (i + 1) * size].clone()
                self.bytes += nbytes
        # The chain's first blocks are its most recent: its ends go out before its start.
        for key in reversed(chain):
            if key in self._blocks:
                self._blocks.move_to_end(key)
        while self.bytes > self.budget_bytes:
            _, block = self._blocks.popitem(last=False)
            self.bytes -= block.numel() * block.element_size()

    def as_dict(self) -> dict:
        """For /health: the budget, what is held, and the prompt tokens taken from it or
        computed since start."""
        return {
            "budget_mb": round(self.budget_bytes / 2**20, 1),
            "used_mb": round(self.bytes / 2**20, 1),
            "blocks": len(self._blocks),
            "reused_tokens": self.hits,
            "computed_tokens": self.misses,
        }

    def clear(self) -> None:
        self._blocks.clear()
        self.bytes = 0
