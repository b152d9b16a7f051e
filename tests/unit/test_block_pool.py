"""BlockPool: exact free-queue order, LRU eviction of cached-free blocks, revival from the middle."""

import pytest

from scheduler_svc.kv.block_pool import BlockPool


def _fill(pool: BlockPool) -> list:
    return [pool.allocate() for _ in range(pool.num_blocks)]


def test_fresh_pool_hands_out_ids_in_order_and_refuses_when_empty():
    pool = BlockPool(3)
    assert pool.free_block_ids() == [0, 1, 2]
    assert [pool.allocate().block_id for _ in range(3)] == [0, 1, 2]
    assert pool.num_free_blocks == 0
    with pytest.raises(MemoryError):
        pool.allocate()
    pool.check_integrity()


def test_cached_blocks_go_to_the_tail_plain_blocks_to_the_head():
    pool = BlockPool(4)
    b0, b1, b2, b3 = _fill(pool)
    assert pool.cache(b1, 111, (1,), -1) and pool.cache(b2, 222, (2,), b1.serial)
    pool.release(b2)
    pool.release(b1)
    pool.release(b0)
    pool.release(b3)
    assert pool.free_block_ids() == [3, 0, 2, 1]
    assert pool.num_cached_free_blocks == 2
    pool.check_integrity()
    # LRU eviction: plain blocks first, then the least recently freed cached block (2), then 1.
    assert [pool.allocate().block_id for _ in range(3)] == [3, 0, 2]
    assert 222 not in pool.cached and b2.block_hash is None and b2.token_ids == ()
    assert pool.cached == {111: b1}
    assert pool.num_cached_free_blocks == 1
    pool.check_integrity()


def test_a_cached_free_block_is_revived_from_the_middle_of_the_queue():
    pool = BlockPool(5)
    blocks = _fill(pool)
    for b in blocks:
        pool.cache(b, 1000 + b.block_id, (b.block_id,), -1)
    for b in blocks:
        pool.release(b)
    assert pool.free_block_ids() == [0, 1, 2, 3, 4]
    hit = pool.lookup(1002, (2,), -1)
    assert hit is blocks[2]
    pool.touch(hit)
    assert hit.ref_cnt == 1 and pool.free_block_ids() == [0, 1, 3, 4]
    assert pool.num_free_blocks == 4 and pool.num_cached_free_blocks == 4
    pool.check_integrity()
    pool.release(hit)  # back at the tail: most recently used
    assert pool.free_block_ids() == [0, 1, 3, 4, 2]
    pool.check_integrity()


def test_lookup_confirms_tokens_and_parent_serial():
    pool = BlockPool(2)
    b0, b1 = _fill(pool)
    pool.cache(b0, 7, (1, 2), -1)
    assert pool.lookup(7, (1, 2), -1) is b0
    assert pool.lookup(7, (1, 3), -1) is None  # same hash, other tokens
    assert pool.lookup(7, (1, 2), 5) is None  # same tokens, other parent
    assert not pool.cache(b1, 7, (9, 9), -1)  # the hash is taken: b1 stays unpublished
    assert b1.block_hash is None


def test_integrity_check_catches_a_corrupted_refcount():
    pool = BlockPool(2)
    b0 = pool.allocate()
    b0.ref_cnt = 0  # freed without joining the queue
    with pytest.raises(AssertionError):
        pool.check_integrity()
