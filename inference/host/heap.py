"""glibc's heap, told when to give memory back (the engine under 1000 MB of RSS).

Freed memory below the mmap threshold stays in the process's heap until the top of the heap
is free or `malloc_trim` returns the free pages inside it. Loading frees ~1 GB of float
weights in pieces; a prefill frees its activations (a 157-token prompt: ~40 MB that stayed
in RSS after the answer, measured on the Qwen shape, and more with each longer prompt).
No-ops where the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

_M_MMAP_THRESHOLD = -3
# Below this share of MemTotal available, the caches let go of what they keep for later.
LOW_MEMORY_SHARE = 0.10


@functools.cache
def _libc():
    name = ctypes.util.find_library("c")
    return ctypes.CDLL(name) if name else None


def mmap_threshold(size: int) -> None:
    """Serve allocations of `size` bytes and more from mmap, with no dynamic raising.

    While loading, 1 MB: freed weights then leave RSS at once (the dynamic threshold rises
    after the first big free, and freed weights stay in the heap). After loading, 32 MB (the
    dynamic maximum), so the per-token activations come from the heap without page faults.
    """
    libc = _libc()
    if libc is not None and hasattr(libc, "mallopt"):
        libc.mallopt(_M_MMAP_THRESHOLD, size)


def trim() -> None:
    """Give the heap's free pages back to the system (all arenas; a fraction of a ms)."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def memory_is_short() -> bool:
    """True when the available memory is under LOW_MEMORY_SHARE of the PC's RAM."""
    import psutil

    memory = psutil.virtual_memory()
    return memory.available < LOW_MEMORY_SHARE * memory.total
