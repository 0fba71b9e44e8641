"""The shared prefix cache's bookkeeping on small caches: a prefix comes back bit for bit,
only whole blocks (or, with `partial`, up to the first different token) and never the last
prompt token, a different token ends the match, the budget holds by recency with a prefix
outliving its ends, and low memory empties it."""

from __future__ import annotations

import torch

from inference.model.kvcache import SequenceCache
from inference.model.prefix_cache import BLOCK, PrefixCache

SHAPE = (2, 1, 4)  # layers, kv_heads, head_dim
PER_BLOCK = 2 * 2 * 1 * BLOCK * 4 * 2  # layers x keys/values x heads x tokens x dim x fp16


def filled(prompt_ids: list[int]) -> SequenceCache:
    """A cache whose every position holds values made from its token and position."""
    cache = SequenceCache(*SHAPE, capacity=len(prompt_ids) + 8, dtype=torch.float16)
    cache.reserve(len(prompt_ids))
    ids = torch.tensor(prompt_ids, dtype=torch.float16)
    positions = torch.arange(len(prompt_ids), dtype=torch.float16)
    cache.buffer()[:, 0, :, : len(prompt_ids)] = (ids / 7 + positions)[None, None, :, None]
    cache.buffer()[:, 1, :, : len(prompt_ids)] = (ids / 3 - positions)[None, None, :, None]
    cache.commit(len(prompt_ids))
    return cache


def empty(capacity: int) -> SequenceCache:
    return SequenceCache(*SHAPE, capacity=capacity, dtype=torch.float16)


def prompt(length: int, start: int = 1) -> list[int]:
    return list(range(start, start + length))


def test_a_kept_prefix_comes_back_bit_for_bit():
    store, ids = PrefixCache(1 << 20), prompt(3 * BLOCK + 5)
    store.keep(ids, filled(ids))
    assert len(store) == 3
    longer = ids + [9, 9, 9]
    fresh = empty(len(longer))
    assert store.restore(longer, fresh) == 3 * BLOCK
    assert fresh.length == 3 * BLOCK
    reference = filled(longer).buffer()[:, :, :, : 3 * BLOCK]
    assert torch.equal(fresh.buffer()[:, :, :, : 3 * BLOCK], reference)


def test_the_last_prompt_token_is_always_computed():
    store, ids = PrefixCache(1 << 20), prompt(2 * BLOCK)
    store.keep(ids, filled(ids))
    assert store.restore(ids, empty(len(ids))) == BLOCK  # not both: the last token must run


def test_a_different_token_ends_the_match_at_its_block():
    store, ids = PrefixCache(1 << 20), prompt(4 * BLOCK)
    store.keep(ids, filled(ids))
    other = list(ids)
    other[2 * BLOCK + 3] = 0
    assert store.restore(other, empty(len(other))) == 2 * BLOCK
    other[0] = 0  # the first block differs: nothing after it can match either
    assert store.restore(other, empty(len(other))) == 0
    assert store.misses == 2 * BLOCK + 4 * BLOCK


def test_the_budget_holds_and_a_prefix_outlives_its_ends():
    store = PrefixCache(5 * PER_BLOCK)
    first, second = prompt(4 * BLOCK + 1), prompt(4 * BLOCK + 1, start=1000)
    store.keep(first, filled(first))
    store.keep(second, filled(second))
    assert store.bytes <= 5 * PER_BLOCK and len(store) == 5
    # what is left of the older prompt is its start, not its end
    assert store.restore(first, empty(len(first))) == BLOCK
    assert store.restore(second, empty(len(second))) == 4 * BLOCK


def test_low_memory_gives_everything_back():
    short = [False]
    store = PrefixCache(1 << 20, memory_is_short=lambda: short[0])
    ids = prompt(2 * BLOCK + 1)
    store.keep(ids, filled(ids))
    assert len(store) == 2 and store.bytes == 2 * PER_BLOCK
    short[0] = True
    store.keep(prompt(BLOCK + 1, start=500), filled(prompt(BLOCK + 1, start=500)))
    assert len(store) == 0 and store.bytes == 0


def test_counting_the_cached_tokens_changes_nothing():
    store = PrefixCache(6 * PER_BLOCK)
    first, second = prompt(3 * BLOCK + 1), prompt(3 * BLOCK + 1, start=1000)
    store.keep(first, filled(first))
    store.keep(second, filled(second))
    assert store.cached_tokens(second) == 3 * BLOCK
    assert store.cached_tokens(first[:-1]) == 2 * BLOCK  # its last token is never counted
    assert store.cached_tokens(first) == 3 * BLOCK  # counted last: a restore would renew it
    assert (store.hits, store.misses) == (0, 0)
    # first is still the least recent: one more block makes it give up its end, not second's
    third = prompt(BLOCK + 1, start=5000)
    store.keep(third, filled(third))
    assert store.cached_tokens(first) == 2 * BLOCK
    assert store.cached_tokens(second) == 3 * BLOCK


def test_a_partial_prefix_ends_at_the_first_different_token():
    store, ids = PrefixCache(1 << 20, partial=True), prompt(3 * BLOCK + 5)
    store.keep(ids, filled(ids))
    other = ids[: 2 * BLOCK + 7] + [0, 0, 0]
    fresh = empty(len(other))
    assert store.cached_tokens(other) == 2 * BLOCK + 7
    assert store.restore(other, fresh) == 2 * BLOCK + 7
    assert fresh.length == 2 * BLOCK + 7
    reference = filled(ids).buffer()[:, :, :, : 2 * BLOCK + 7]
    assert torch.equal(fresh.buffer()[:, :, :, : 2 * BLOCK + 7], reference)
    # inside the first block too, and never the last prompt token
    assert store.cached_tokens(ids[:5] + [0]) == 5
    assert store.cached_tokens(ids[:5]) == 4
    assert PrefixCache(1 << 20).cached_tokens(other) == 0  # without partial: whole blocks
    whole = PrefixCache(1 << 20)
    whole.keep(ids, filled(ids))
    assert whole.cached_tokens(other) == 2 * BLOCK


def test_a_partial_prefix_takes_the_sibling_that_shares_most():
    store = PrefixCache(1 << 20, partial=True)
    stem = prompt(BLOCK)
    near, nearer = stem + prompt(BLOCK + 1, start=100), stem + prompt(BLOCK + 1, start=100)
    near[BLOCK + 3] = nearer[BLOCK + 9] = 0
    for ids in (near, nearer):
        store.keep(ids, filled(ids))
    asked = stem + prompt(BLOCK + 1, start=100)
    assert store.cached_tokens(asked) == BLOCK + 9
    fresh = empty(len(asked))
    assert store.restore(asked, fresh) == BLOCK + 9
    assert torch.equal(
        fresh.buffer()[:, :, :, : BLOCK + 9], filled(nearer).buffer()[:, :, :, : BLOCK + 9]
    )


def test_an_evicted_block_is_no_partial_match():
    store = PrefixCache(2 * PER_BLOCK, partial=True)
    first = prompt(2 * BLOCK)
    store.keep(first, filled(first))
    asked = first[: BLOCK + 4] + [0]
    assert store.cached_tokens(asked) == BLOCK + 4
    other = prompt(BLOCK, start=1000)
    store.keep(other, filled(other))  # the budget holds two blocks: first's end goes
    assert store.cached_tokens(asked) == BLOCK
    assert store.cached_tokens(other[:6] + [0]) == 6
    store.clear()
    assert store.cached_tokens(other[:6] + [0]) == 0


def test_the_part_filled_last_block_is_kept_too():
    """A finished answer's last, part-filled block: the next question after it computes
    only its own tokens. Not kept twice, not kept without `partial`, counted in bytes."""
    store, ids = PrefixCache(1 << 20, partial=True), prompt(2 * BLOCK + 5)
    store.keep(ids, filled(ids))
    assert len(store) == 3 and store.bytes == 2 * PER_BLOCK + 5 * PER_BLOCK // BLOCK
    follow = ids + [7, 7]
    fresh = empty(len(follow))
    assert store.restore(follow, fresh) == len(ids)
    assert torch.equal(
        fresh.buffer()[:, :, :, : len(ids)], filled(ids).buffer()[:, :, :, : len(ids)]
    )
    store.keep(ids[:-2], filled(ids[:-2]))  # a shorter tail the kept one covers: nothing new
    assert len(store) == 3
    whole = PrefixCache(1 << 20)
    whole.keep(ids, filled(ids))
    assert len(whole) == 2 and whole.cached_tokens(follow) == 2 * BLOCK
