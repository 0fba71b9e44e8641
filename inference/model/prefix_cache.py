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

Where a row's bits depend on its position alone (`partial`: the native step, whose rows
may be computed in any chunks, one row included), a prefix may also end inside a block:
after the whole blocks found, the child block of the last one (blocks know their parent
and their tokens) that shares the most of the prompt's next tokens gives those positions
too. A tool's fixed system prompt then costs only its question: its last, part-filled
block, up to 15 tokens computed again on every request otherwise, comes from the cache.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

import torch

from inference.host.heap import memory_is_short
from inference.model.kvcache import SequenceCache

BLOCK = 16  # tokens per block, by default: the engine's chunk alignment on per-row weights


def _digest(parent: bytes, tokens: list[int]) -> bytes:
    """A block's hash: its parent's and its own tokens (a part-filled block has fewer tokens,
    so never the hash of a whole one)."""
    digest = hashlib.blake2b(parent, digest_size=16)
    digest.update(b"".join(t.to_bytes(4, "little") for t in tokens))
    return digest.digest()


def _chain(prompt_ids: list[int], blocks: int, block: int) -> list[bytes]:
    """The hash of each of the first `blocks` blocks, each covering all blocks before it."""
    hashes, previous = [], b""
    for i in range(blocks):
        previous = _digest(previous, prompt_ids[i * block : (i + 1) * block])
        hashes.append(previous)
    return hashes


@dataclass(frozen=True)
class _Block:
    """One block's keys and values [layers, 2, kv_heads, block, head_dim], the hash of the
    block before it (b"" for a prompt's first) and its tokens (a partial match reads them)."""

    kv: torch.Tensor
    parent: bytes
    tokens: tuple[int, ...]


class PrefixCache:
    """Blocks of keys and values by prefix hash, least recently used first out."""

    def __init__(
        self,
        budget_bytes: int,
        block: int = BLOCK,
        memory_is_short=memory_is_short,
        partial: bool = False,
    ):
        """`block`: tokens per block, a multiple of the engine's prefill chunk alignment (a
        restored prefix must end where a fresh prefill's chunk would). `partial`: a prefix
        may end inside a block (only where a row's bits depend on its position alone)."""
        self.budget_bytes = budget_bytes
        self.block = block
        self.partial = partial
        self.bytes = 0
        self.hits = self.misses = 0  # prompt tokens taken from the cache / computed
        self._blocks: OrderedDict[bytes, _Block] = OrderedDict()
        self._children: dict[bytes, set[bytes]] = {}  # parent hash -> its blocks' hashes
        self._memory_is_short = memory_is_short

    def __len__(self) -> int:
        return len(self._blocks)

    def _found(self, prompt_ids: list[int]) -> tuple[list[tuple[bytes, _Block]], int]:
        """The cached blocks of the longest cached prefix of `prompt_ids`, never its last
        token (whose forward gives the first answer token's logits), and its length in
        tokens (with `partial`, the last block may give only its first few)."""
        found, parent = [], b""
        for key in _chain(prompt_ids, (len(prompt_ids) - 1) // self.block, self.block):
            block = self._blocks.get(key)
            if block is None:
                break
            found.append((key, block))
            parent = key
        tokens = len(found) * self.block
        if self.partial:
            rest = prompt_ids[tokens : len(prompt_ids) - 1]
            best, shared = self._longest_child(parent, rest)
            if shared:
                found.append(best)
                tokens += shared
        return found, tokens

    def _longest_child(self, parent: bytes, tokens: list[int]) -> tuple[tuple | None, int]:
        """The kept block after `parent` that starts with the most of `tokens`, and how
        many. A copy of the children: a request thread counting (cached_tokens) may look
        while the inference thread keeps and drops blocks."""
        best, shared = None, 0
        for key in list(self._children.get(parent, ())):
            block = self._blocks.get(key)
            n = _common(block.tokens, tokens) if block is not None else 0
            if n > shared:
                best, shared = (key, block), n
        return best, shared

    def cached_tokens(self, prompt_ids: list[int]) -> int:
        """How many prompt tokens `restore` would take from the cache now: admission's
        estimate counts only the rest (web/relay.py). Called from request threads while the
        inference thread keeps and drops blocks: single dict lookups (atomic under CPython's
        GIL; a free-threaded build would need a lock), recency untouched. Blocks may go
        before the job starts; it is an estimate."""
        return self._found(prompt_ids)[1]

    def restore(self, prompt_ids: list[int], cache: SequenceCache) -> int:
        """Copy the longest cached prefix of `prompt_ids` into the empty `cache`; returns its
        length in tokens. The last prompt token is always left to compute."""
        size = self.block
        found, tokens = self._found(prompt_ids)
        for key, _ in reversed(found):  # a prefix is used at least as recently as its ends
            self._blocks.move_to_end(key)
        if tokens:
            cache.reserve(tokens)
            buffer = cache.buffer()
            for i, (_, block) in enumerate(found):
                end = min(tokens, (i + 1) * size)
                buffer[:, :, :, i * size : end] = block.kv[:, :, :, : end - i * size]
            cache.commit(tokens)
        self.hits += tokens
        self.misses += len(prompt_ids) - tokens
        return tokens

    def keep(self, prompt_ids: list[int], cache: SequenceCache) -> None:
        """Keep the blocks of `prompt_ids` that `cache` holds and this cache lacks: whole
        blocks, and with `partial` the part-filled last one too, so the next question of a
        conversation computes only what follows the answer, not also the answer's last
        block again."""
        if self._memory_is_short():
            self.clear()
            return
        size, buffer = self.block, cache.buffer()
        if buffer[:, :, :, :size].numel() * buffer.element_size() > self.budget_bytes:
            return
        held = min(len(prompt_ids), cache.length)
        chain = _chain(prompt_ids, held // size, size)
        for i, key in enumerate(chain):
            self._add(key, chain[i - 1] if i else b"", prompt_ids, i * size, buffer)
        ends = list(chain)
        start = len(chain) * size
        parent = chain[-1] if chain else b""
        tail = prompt_ids[start:held]
        if self.partial and tail and self._longest_child(parent, tail)[1] < len(tail):
            ends.append(_digest(parent, tail))
            self._add(ends[-1], parent, prompt_ids[:held], start, buffer)
        # The chain's first blocks are its most recent: its ends go out before its start.
        for key in reversed(ends):
            if key in self._blocks:
                self._blocks.move_to_end(key)
        while self.bytes > self.budget_bytes:
            key, block = self._blocks.popitem(last=False)
            self.bytes -= block.kv.numel() * block.kv.element_size()
            siblings = self._children.get(block.parent)
            if siblings is not None:
                siblings.discard(key)
                if not siblings:
                    del self._children[block.parent]

    def _add(self, key: bytes, parent: bytes, ids: list[int], start: int, buffer) -> None:
        """Keep the block `key` of ids[start : start + block] (fewer at the end of `ids`)."""
        if key in self._blocks:
            return
        tokens = tuple(ids[start : start + self.block])
        kv = buffer[:, :, :, start : start + len(tokens)].clone()
        self._blocks[key] = _Block(kv, parent, tokens)
        self._children.setdefault(parent, set()).add(key)
        self.bytes += kv.numel() * kv.element_size()

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
        self._children.clear()
        self.bytes = 0


def _common(a: tuple[int, ...], b: list[int]) -> int:
    """How many leading tokens `a` and `b` share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
