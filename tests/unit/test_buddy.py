import random

import pytest

from scheduler_svc.kv.buddy import BuddyAllocator, order_for


def test_order_for_rounds_up_to_a_power_of_two():
    assert [order_for(n) for n in (1, 2, 3, 4, 5, 8, 9, 128, 129)] == [0, 1, 2, 2, 3, 3, 4, 7, 8]
    with pytest.raises(ValueError):
        order_for(0)


def test_non_power_of_two_range_is_cut_into_aligned_pieces():
    buddy = BuddyAllocator(13)
    assert buddy.free_blocks_by_order() == {3: [0], 2: [8], 0: [12]}
    assert buddy.num_free_blocks == 13
    assert buddy.largest_free_order == 3
    buddy.check_integrity()


def test_allocation_splits_and_takes_the_lowest_address():
    buddy = BuddyAllocator(16)
    assert buddy.allocate(3) == 0  # rounded to 4 blocks: [0, 4)
    assert buddy.size_of(0) == 4
    assert buddy.free_blocks_by_order() == {2: [4], 3: [8]}
    assert buddy.allocate(1) == 4
    assert buddy.free_blocks_by_order() == {0: [5], 1: [6], 3: [8]}
    assert buddy.allocate(2) == 6
    assert buddy.allocate(1) == 5
    assert buddy.allocate(5) == 8
    assert buddy.free_blocks_by_order() == {}
    assert buddy.num_free_blocks == 0
    assert buddy.num_requested_blocks == 3 + 1 + 2 + 1 + 5
    assert buddy.num_internal_fragment_blocks == 16 - 12
    assert not buddy.can_allocate(1)
    with pytest.raises(MemoryError):
        buddy.allocate(1)
    buddy.check_integrity()


def test_free_coalesces_buddies_back_to_the_whole_range():
    buddy = BuddyAllocator(16)
    a, b, c, d = (buddy.allocate(4) for _ in range(4))
    assert (a, b, c, d) == (0, 4, 8, 12)
    buddy.free(b)
    assert buddy.free_blocks_by_order() == {2: [4]}
    buddy.free(c)  # 8 is not the buddy of 4 (buddy of 4 is 0): no merge
    assert buddy.free_blocks_by_order() == {2: [4, 8]}
    buddy.free(a)  # 0 + 4 -> order 3 @ 0
    assert buddy.free_blocks_by_order() == {2: [8], 3: [0]}
    buddy.free(d)  # 12 + 8 -> order 3 @ 8, then with 0 -> order 4 @ 0
    assert buddy.free_blocks_by_order() == {4: [0]}
    buddy.check_integrity()


def test_external_fragmentation_refuses_a_request_that_fits_in_total():
    buddy = BuddyAllocator(16)
    starts = [buddy.allocate(2) for _ in range(8)]
    for start in starts[::2]:
        buddy.free(start)
    assert buddy.num_free_blocks == 8
    assert buddy.largest_free_order == 1
    assert not buddy.can_allocate(4)
    assert buddy.can_allocate(2)


def test_num_allocatable_counts_what_splitting_can_serve():
    buddy = BuddyAllocator(13)  # 8 @ 0, 4 @ 8, 1 @ 12
    assert [buddy.num_allocatable(n) for n in (1, 2, 3, 4, 5, 8, 9)] == [13, 6, 3, 3, 1, 1, 0]
    assert buddy.num_allocatable_when_empty(4) == 3
    for _ in range(3):
        buddy.allocate(4)
    assert buddy.num_allocatable(4) == 0
    assert buddy.num_allocatable(1) == 1
    assert buddy.num_allocatable_when_empty(4) == 3


def test_top_level_pieces_never_merge_across_the_range_end():
    buddy = BuddyAllocator(12)  # 8 @ 0, 4 @ 8
    x = buddy.allocate(4)
    assert x == 8  # the order-2 piece is used before splitting the order-3 one
    buddy.free(x)
    assert buddy.free_blocks_by_order() == {2: [8], 3: [0]}
    assert not buddy.can_allocate(9)


def test_double_free_and_unknown_start_raise():
    buddy = BuddyAllocator(8)
    start = buddy.allocate(2)
    buddy.free(start)
    with pytest.raises(KeyError):
        buddy.free(start)
    with pytest.raises(KeyError):
        buddy.free(3)


@pytest.mark.parametrize("num_blocks", [1, 7, 64, 100, 983])
def test_random_allocate_free_keeps_the_tiling_and_returns_to_the_start(num_blocks):
    rng = random.Random(num_blocks)
    buddy = BuddyAllocator(num_blocks)
    initial = buddy.free_blocks_by_order()
    live: list[int] = []
    for _ in range(400):
        if live and rng.random() < 0.45:
            buddy.free(live.pop(rng.randrange(len(live))))
        else:
            size = rng.randint(1, max(1, num_blocks // 4))
            if buddy.can_allocate(size):
                start = buddy.allocate(size)
                assert start % buddy.size_of(start) == 0
                live.append(start)
        buddy.check_integrity()
    for start in live:
        buddy.free(start)
    assert buddy.free_blocks_by_order() == initial
    assert buddy.num_free_blocks == num_blocks
