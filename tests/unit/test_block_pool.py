"""Block pool: exact block ids, ref counts, LRU eviction order, the hash map, double free."""

from __future__ import annotations

import pytest

from octavo.core.block_pool import BlockPool, hash_block_tokens


def ids(blocks):
    return [b.block_id for b in blocks]


def test_fresh_pool_hands_out_blocks_in_id_order():
    pool = BlockPool(8, enable_prefix_caching=True)
    assert ids(pool.allocate(3)) == [0, 1, 2]
    assert ids(pool.allocate(2)) == [3, 4]
    assert pool.num_free_blocks == 3
    assert pool.num_total_blocks == 8
    assert pool.usage == pytest.approx(5 / 8)


def test_ref_counts_follow_allocate_touch_incref_free():
    pool = BlockPool(4, enable_prefix_caching=True)
    a, b = pool.allocate(2)
    assert (a.ref_cnt, b.ref_cnt, pool.num_shared_refs) == (1, 1, 0)
    pool.touch([a])
    pool.incref([a, b])
    assert (a.ref_cnt, b.ref_cnt, pool.num_shared_refs) == (3, 2, 3)
    pool.free([a, b])
    assert (a.ref_cnt, b.ref_cnt, pool.num_shared_refs) == (2, 1, 1)
    assert pool.free_block_ids() == [2, 3]  # neither reached 0
    with pytest.raises(RuntimeError, match="double free"):
        pool.free([b, b])
    pool.free([a, a, b])
    assert pool.num_shared_refs == 0 and pool.num_free_blocks == 4


def test_freed_blocks_go_to_the_back_in_the_order_given():
    pool = BlockPool(6, enable_prefix_caching=True)
    blocks = pool.allocate(4)  # 0..3; free queue [4, 5]
    for block in blocks:
        pool.cache_block(block, 100 + block.block_id)
    pool.free([blocks[2], blocks[0]])
    assert pool.free_block_ids() == [4, 5, 2, 0]
    pool.free([blocks[3], blocks[1]])
    assert pool.free_block_ids() == [4, 5, 2, 0, 3, 1]
    assert ids(pool.allocate(5)) == [4, 5, 2, 0, 3]


def test_freed_blocks_holding_no_cached_prefix_are_taken_first():
    """They hold nothing worth keeping: taking them again evicts no cached block and touches
    no block never used (on the CPU, memory the operating system has not mapped yet)."""
    pool = BlockPool(6, enable_prefix_caching=True)
    blocks = pool.allocate(4)  # 0..3; free queue [4, 5]
    pool.cache_block(blocks[0], 7)
    pool.free(blocks)
    assert pool.free_block_ids() == [3, 2, 1, 4, 5, 0]
    assert ids(pool.allocate(3)) == [3, 2, 1]
    assert pool.get_cached_block(7) is blocks[0]


def test_allocating_more_than_free_raises_and_changes_nothing():
    pool = BlockPool(3, enable_prefix_caching=True)
    pool.allocate(2)
    with pytest.raises(RuntimeError, match="only 1 free"):
        pool.allocate(2)
    assert pool.free_block_ids() == [2]


def test_double_free_raises_and_changes_nothing():
    pool = BlockPool(4, enable_prefix_caching=True)
    a, b = pool.allocate(2)
    pool.free([a])
    with pytest.raises(RuntimeError, match="double free of block 0"):
        pool.free([a])
    # A list that frees b twice is refused as a whole: b keeps its reference.
    with pytest.raises(RuntimeError, match="double free of block 1"):
        pool.free([b, b])
    assert b.ref_cnt == 1
    assert pool.free_block_ids() == [0, 2, 3]  # a holds no cached prefix: first


def test_incref_of_a_free_block_is_a_bug():
    pool = BlockPool(2, enable_prefix_caching=True)
    with pytest.raises(AssertionError):
        pool.incref([pool.blocks[0]])


def test_cached_block_is_found_until_reallocation_evicts_it():
    pool = BlockPool(3, enable_prefix_caching=True)
    a, b = pool.allocate(2)
    pool.cache_block(a, 111)
    pool.free([a, b])  # free queue [1, 2, 0]: b holds no cached prefix
    assert pool.get_cached_block(111) is a
    assert a.block_hash == 111
    assert ids(pool.allocate(2)) == [1, 2]
    assert pool.get_cached_block(111) is a  # not reused yet
    assert ids(pool.allocate(1)) == [0]
    assert pool.get_cached_block(111) is None
    assert a.block_hash is None
    assert dict(pool.cached_blocks) == {}


def test_touch_revives_a_cached_block_from_the_middle_of_the_free_queue():
    pool = BlockPool(4, enable_prefix_caching=True)
    blocks = pool.allocate(4)
    pool.cache_block(blocks[1], 7)
    pool.free(blocks)
    assert pool.free_block_ids() == [3, 2, 0, 1]
    hit = pool.get_cached_block(7)
    pool.touch([hit])
    assert hit.ref_cnt == 1
    assert pool.free_block_ids() == [3, 2, 0]
    assert pool.num_free_blocks == 3
    assert ids(pool.allocate(3)) == [3, 2, 0]
    assert pool.get_cached_block(7) is hit  # in use, so never evicted


def test_duplicate_hash_keeps_the_existing_mapping():
    pool = BlockPool(2, enable_prefix_caching=True)
    a, b = pool.allocate(2)
    pool.cache_block(a, 5)
    pool.cache_block(b, 5)
    assert pool.get_cached_block(5) is a
    assert b.block_hash is None
    pool.cache_block(a, 5)  # same hash again is a no-op
    assert dict(pool.cached_blocks) == {5: a}


def test_prefix_caching_off_caches_nothing():
    pool = BlockPool(2, enable_prefix_caching=False)
    (a,) = pool.allocate(1)
    pool.cache_block(a, 5)
    assert pool.get_cached_block(5) is None
    assert a.block_hash is None


def test_reset_prefix_cache_drops_only_unused_blocks():
    pool = BlockPool(3, enable_prefix_caching=True)
    a, b = pool.allocate(2)
    pool.cache_block(a, 1)
    pool.cache_block(b, 2)
    pool.free([a])
    assert pool.reset_prefix_cache() is False  # b is in use and keeps its hash
    assert dict(pool.cached_blocks) == {2: b}
    assert a.block_hash is None
    pool.free([b])
    assert pool.reset_prefix_cache() is True
    assert dict(pool.cached_blocks) == {}
    assert pool.free_block_ids() == [2, 0, 1]  # reset does not reorder the free queue


def test_pool_size_must_be_positive():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0, enable_prefix_caching=True)


def test_block_hash_is_chained_and_positional():
    first = hash_block_tokens(None, [1, 2, 3, 4])
    assert first == hash_block_tokens(None, [1, 2, 3, 4])
    assert first != hash_block_tokens(None, [4, 3, 2, 1])
    assert first != hash_block_tokens(0, [1, 2, 3, 4])  # no parent != parent hash 0
    assert hash_block_tokens(first, [5, 6]) != hash_block_tokens(None, [5, 6])
    assert 0 <= first < 2**64


def test_block_hash_is_pinned():
    # The same tokens must hash the same in every process and every run (workers, restarts),
    # so the encoding is pinned: changing it must be a deliberate act.
    first = hash_block_tokens(None, [1, 2, 3, 4])
    assert first == 4869509296380433915
    assert hash_block_tokens(first, [5, 6, 7, 8]) == 9480200831212388384
