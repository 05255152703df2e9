"""data_plane/kv/prefix_cache.py: the hash chain, reference counts, the LRU of evictable
blocks (eviction order, a block in use never evicted) and collisions as misses."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from data_plane.kv.block_pool import OutOfBlocksError
from data_plane.kv.prefix_cache import ROOT_KEY, CachingBlockPool, block_keys

BS = 4


def _cache_prefix(pool: CachingBlockPool, tokens: list[int]) -> list[int]:
    """Allocate and index the full blocks of ``tokens``, as a finished prefill would."""
    keys = block_keys(tokens, BS)
    ids = pool.allocate(len(keys))
    parent = ROOT_KEY
    for i, (block_id, key) in enumerate(zip(ids, keys, strict=True)):
        pool.register(block_id, key, parent, tokens[i * BS : (i + 1) * BS])
        parent = key
    return ids


def _hits(pool: CachingBlockPool, tokens: list[int]) -> list[int]:
    hits, parent = [], ROOT_KEY
    for i, key in enumerate(block_keys(tokens, BS)):
        block_id = pool.cached_block(key, parent, tokens[i * BS : (i + 1) * BS])
        if block_id is None:
            break
        hits.append(block_id)
        parent = key
    return hits


def test_keys_chain_over_the_prefix() -> None:
    a = block_keys([1, 2, 3, 4, 5, 6, 7, 8, 9], BS)
    b = block_keys([1, 2, 3, 4, 5, 6, 7, 0], BS)
    c = block_keys([0, 2, 3, 4, 5, 6, 7, 8], BS)
    assert len(a) == 2 and a[0] == b[0] and a[1] != b[1]  # same first block, then differ
    assert c[1] != a[1]  # the same second block after another first one is another key
    assert block_keys([1, 2, 3, 4, 5, 6, 7, 8], BS, start=1, parent=a[0]) == a[1:]


def test_shared_blocks_are_counted_and_parked_not_freed() -> None:
    pool = CachingBlockPool(6, "hbm")
    tokens = list(range(12))
    ids = _cache_prefix(pool, tokens)
    assert pool.num_free == 3 and pool.num_cached == 3
    for block_id in _hits(pool, tokens):
        pool.take(block_id)  # a second request shares them
    pool.free(ids)  # the first request ends: still in use by the second
    assert pool.num_free == 3 and all(pool.refs(b) == 1 for b in ids)
    pool.free(ids)  # the second ends: parked, still indexed, counted free
    assert pool.num_free == 6 and pool.num_cached == 3
    assert _hits(pool, tokens) == ids
    with pytest.raises(RuntimeError, match="twice"):
        pool.free(ids[:1])


def test_changes_a_lookup_could_see_are_reported_once() -> None:
    """Indexing, the last release, a take from the LRU and an eviction each report the
    block's key; taking or releasing a block others still hold, or an uncached one, does not
    (a waiting request's hits cannot change then)."""
    pool = CachingBlockPool(4, "hbm")
    tokens = list(range(8))
    keys = block_keys(tokens, BS)
    ids = _cache_prefix(pool, tokens)
    assert pool.drain_changed_keys() == set(keys) and pool.drain_changed_keys() == set()
    pool.take(ids[0])  # shared by a second request: still in use
    pool.free(ids[:1])
    assert pool.drain_changed_keys() == set()
    pool.free(ids)  # the last holders end: both evictable
    assert pool.drain_changed_keys() == set(keys)
    pool.take(ids[1])  # back in use
    assert pool.drain_changed_keys() == {keys[1]}
    pool.free(pool.allocate(2))  # the free list's uncached blocks
    assert pool.drain_changed_keys() == set()
    pool.allocate(3)  # two free, then the LRU's evictable first block: evicted
    assert pool.drain_changed_keys() == {keys[0]}


def test_eviction_takes_free_blocks_first_then_the_least_recently_released() -> None:
    pool = CachingBlockPool(4, "hbm")
    first = _cache_prefix(pool, [1] * 4 + [2] * 4)
    second = _cache_prefix(pool, [3] * 4 + [4] * 4)
    pool.free(second)  # released first: evicted first
    pool.free(first)
    taken = pool.allocate(1)
    assert taken == [second[0]] and pool.counters.num_evicted_blocks == 1
    assert _hits(pool, [3] * 4 + [4] * 4) == []  # its first block is gone: no prefix left
    assert _hits(pool, [1] * 4 + [2] * 4) == first
    for block_id in first:
        pool.take(block_id)  # in use again: never evicted
    assert pool.allocate(1) == [second[1]]
    with pytest.raises(OutOfBlocksError):
        pool.allocate(1)
    assert _hits(pool, [1] * 4 + [2] * 4) == first


def test_a_hash_collision_is_a_miss() -> None:
    pool = CachingBlockPool(2, "hbm")
    (block_id,) = pool.allocate(1)
    pool.register(block_id, 12345, ROOT_KEY, [1, 2, 3, 4])
    assert pool.cached_block(12345, ROOT_KEY, [1, 2, 3, 4]) == block_id
    assert pool.cached_block(12345, ROOT_KEY, [9, 9, 9, 9]) is None  # same key, other tokens
    assert pool.cached_block(12345, 777, [1, 2, 3, 4]) is None  # same tokens, other parent


def test_the_first_block_with_a_content_stays_indexed() -> None:
    pool = CachingBlockPool(4, "hbm")
    a = _cache_prefix(pool, [5] * 4)
    b = pool.allocate(1)
    assert pool.register(b[0], block_keys([5] * 4, BS)[0], ROOT_KEY, [5] * 4) == a[0]
    pool.free(b)  # not indexed: freed, not parked
    assert pool.num_cached == 1 and pool.num_free == 3


def test_disabled_indexes_nothing() -> None:
    pool = CachingBlockPool(4, "hbm", enabled=False)
    ids = _cache_prefix(pool, [1] * 8)
    assert pool.num_cached == 0 and _hits(pool, [1] * 8) == []
    pool.free(ids)
    assert pool.num_free == 4


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 3)), min_size=1, max_size=60))
def test_random_schedules_never_hand_out_a_block_in_use(ops: list[tuple[int, int]]) -> None:
    """Requests over three shared prefixes start (taking their cached prefix, allocating the
    rest) and end in random order: a block is never held by two requests with different
    contents, the counts add up, and nothing is lost."""
    pool = CachingBlockPool(10, "hbm")
    prefixes = [[p] * 4 + [p + 10] * 4 + [p + 20] * 4 for p in range(3)]
    live: list[tuple[list[int], list[int]]] = []  # (tokens, block ids) per running request
    holder: dict[int, tuple[int, ...]] = {}  # block id -> content its holders expect
    for prefix, action in ops:
        if action == 0 and live:
            tokens, ids = live.pop(0)
            pool.free(ids)
            continue
        tokens = prefixes[prefix]
        hits = _hits(pool, tokens)
        need = 3 - len(hits)
        if need > pool.num_free - sum(1 for b in hits if pool.refs(b) == 0):
            continue
        for block_id in hits:
            pool.take(block_id)
        fresh = pool.allocate(need)
        ids = hits + fresh
        keys, parent = block_keys(tokens, BS), ROOT_KEY
        for i, block_id in enumerate(ids):
            content = tuple(tokens[i * BS : (i + 1) * BS])
            expected = holder.get(block_id)
            if expected is not None and pool.refs(block_id) > 1:
                assert expected == content  # shared only with a request that wrote the same
            holder[block_id] = content
            pool.register(block_id, keys[i], parent, content)
            parent = keys[i]
        live.append((tokens, ids))
    in_use = sum(len(ids) for _, ids in live)
    assert pool.num_free + len({b for _, ids in live for b in ids}) == 10
    assert in_use >= len({b for _, ids in live for b in ids})
