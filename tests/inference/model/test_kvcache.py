"""Cache buffers kept for the next job (SpareBuffers): a finished job's buffer serves a later
one of its size class, a conversation's next, longer question included; a need of another
class lets every kept buffer go first; while memory is short none is kept and a need lets the
kept ones go; a cache without spares allocates its own as before."""

from __future__ import annotations

import torch

from inference.model.kvcache import SequenceCache, SpareBuffers

SHAPE = (2, 1, 4)  # layers, kv_heads, head_dim: 16 float16 elements a position, 32 bytes
PER_TOKEN = 2 * 2 * 1 * 4 * 2


def job(spares: SpareBuffers, capacity: int) -> SequenceCache:
    """A cache whose whole room is reserved and written, as a prompt's prefill does."""
    cache = SequenceCache(*SHAPE, capacity=capacity, dtype=torch.float16, spares=spares)
    cache.reserve(capacity)
    cache.buffer().fill_(capacity)
    cache.commit(capacity)
    return cache


def test_a_finished_jobs_buffer_serves_the_next_longer_question():
    spares = SpareBuffers(memory_is_short=lambda: False)
    first = job(spares, 300)  # 9,600 bytes: the 16 KiB class
    storage = first.buffer().untyped_storage().data_ptr()
    first.release()
    assert len(spares) == 1 and spares.buffers[0].numel() * 2 == 16 * 1024
    assert first.length == 0 and first.allocated == 0
    second = job(spares, 500)  # 16,000 bytes: the same class, so the same buffer
    assert second.buffer().untyped_storage().data_ptr() == storage
    assert len(spares) == 0
    assert second.buffer().shape == (2, 2, 1, 500, 4)
    assert torch.all(second.buffer() == 500)


def test_another_size_class_lets_the_kept_buffers_go_first():
    spares = SpareBuffers(memory_is_short=lambda: False)
    small, other = job(spares, 20), job(spares, 40)
    small.release()
    other.release()
    assert len(spares) == 2
    big = job(spares, 2000)  # no kept buffer of its class: none stays beside a new one
    assert len(spares) == 0
    big.release()
    assert len(spares) == 1
    spares.clear()
    assert len(spares) == 0


def test_nothing_is_kept_while_memory_is_short():
    short = [True]
    spares = SpareBuffers(memory_is_short=lambda: short[0])
    job(spares, 100).release()
    assert len(spares) == 0
    short[0] = False
    first, second = job(spares, 100), job(spares, 100)
    first.release()
    second.release()
    assert len(spares) == 2
    short[0] = True  # memory ran short while they were kept: the next need lets them all go
    job(spares, 100)
    assert len(spares) == 0


def test_a_growing_cache_keeps_its_positions_and_only_finished_buffers_are_kept():
    spares = SpareBuffers(memory_is_short=lambda: False)
    cache = SequenceCache(*SHAPE, capacity=2000, dtype=torch.float16, spares=spares)
    cache.reserve(10)
    cache.buffer()[:, :, :, :10] = 7
    cache.commit(10)
    cache.reserve(300)  # grows past 256 positions: a new buffer, the positions copied
    assert cache.allocated >= 310
    assert torch.all(cache.buffer()[:, :, :, :10] == 7)
    assert len(spares) == 0  # the outgrown buffer is freed, not kept
    cache.release()
    assert len(spares) == 1


def test_without_spares_a_cache_allocates_its_own():
    cache = SequenceCache(*SHAPE, capacity=50, dtype=torch.float16)
    cache.reserve(50)
    assert cache.buffer().numel() * 2 == 50 * PER_TOKEN  # its room exactly, no size class
    cache.release()
    assert cache.length == 0


def test_a_buffer_made_in_inference_mode_is_written_outside_it_later():
    spares = SpareBuffers(memory_is_short=lambda: False)
    with torch.inference_mode():  # a step grows a cache
        job(spares, 100).release()
    job(spares, 100)  # the next job's open() writes the restored prefix outside it
    assert len(spares) == 0
