"""A binary buddy allocator over the block ids [0, num_blocks).

Used by the contiguous-reservation baselines (`reservation.py`): each sequence gets one contiguous
range of blocks, so the cache shows the fragmentation the paper attributes to Orca-style systems:

- internal: a request for `num_blocks` gets a block of `2**order >= num_blocks` blocks;
- external: free blocks that are split into pieces too small (or misaligned) for the next request.

Blocks are grouped into power-of-two "buddy blocks" aligned to their size. A range that is not a
power of two is first cut into maximal aligned pieces, e.g. 13 blocks = 8 @ 0, 4 @ 8, 1 @ 12; a
top-level piece has no buddy inside the range and never coalesces further.

    order 3: [0 ......................... 8)
    order 2: [0 .......... 4)[4 ......... 8)   buddy of a block at `start` with order k is
    order 1: [0 ... 2)[2 . 4)                  `start ^ (1 << k)`; two free buddies merge.

Allocation takes the lowest-addressed free block of the smallest order that fits (deterministic),
splitting larger blocks and keeping the upper halves free.
"""

from __future__ import annotations


def order_for(num_blocks: int) -> int:
    """Smallest order k with 2**k >= num_blocks."""
    if num_blocks < 1:
        raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
    return (num_blocks - 1).bit_length()


class BuddyAllocator:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.max_order = num_blocks.bit_length() - 1
        # free_starts[k] = starts of the free blocks of order k
        self._free_starts: list[set[int]] = [set() for _ in range(self.max_order + 1)]
        self._allocated_orders: dict[int, int] = {}  # start -> order
        self._num_requested_blocks: dict[int, int] = {}  # start -> blocks asked for
        start = 0
        for order in range(self.max_order, -1, -1):
            if num_blocks & (1 << order):
                self._free_starts[order].add(start)
                start += 1 << order
        self.num_free_blocks = num_blocks

    # ---- queries -------------------------------------------------------------------------------

    @property
    def num_allocated_blocks(self) -> int:
        """Blocks handed out, including the power-of-two rounding."""
        return self.num_blocks - self.num_free_blocks

    @property
    def num_requested_blocks(self) -> int:
        """Blocks asked for by the live allocations (before rounding)."""
        return sum(self._num_requested_blocks.values())

    @property
    def num_internal_fragment_blocks(self) -> int:
        return self.num_allocated_blocks - self.num_requested_blocks

    @property
    def largest_free_order(self) -> int:
        """Order of the largest free block, -1 when nothing is free."""
        for order in range(self.max_order, -1, -1):
            if self._free_starts[order]:
                return order
        return -1

    @property
    def num_allocations(self) -> int:
        return len(self._allocated_orders)

    def free_blocks_by_order(self) -> dict[int, list[int]]:
        """order -> sorted starts of the free blocks of that order (only non-empty orders)."""
        return {k: sorted(s) for k, s in enumerate(self._free_starts) if s}

    def can_allocate(self, num_blocks: int) -> bool:
        order = order_for(num_blocks)
        return order <= self.max_order and self.largest_free_order >= order

    def num_allocatable(self, num_blocks: int) -> int:
        """How many allocations of `num_blocks` blocks would succeed one after another right now."""
        order = order_for(num_blocks)
        return sum(len(starts) << (k - order) for k, starts in enumerate(self._free_starts) if k >= order)

    def num_allocatable_when_empty(self, num_blocks: int) -> int:
        """Like `num_allocatable`, in an allocator with nothing allocated."""
        return self.num_blocks >> order_for(num_blocks)

    def size_of(self, start: int) -> int:
        """Number of blocks held by the allocation starting at `start` (a power of two)."""
        return 1 << self._allocated_orders[start]

    # ---- operations ----------------------------------------------------------------------------

    def allocate(self, num_blocks: int) -> int:
        """Returns the first block id of a free aligned range of `2**order_for(num_blocks)` blocks."""
        order = order_for(num_blocks)
        if not self.can_allocate(num_blocks):
            raise MemoryError(f"no free buddy block of order {order} ({num_blocks} blocks requested)")
        found = order
        while not self._free_starts[found]:
            found += 1
        start = min(self._free_starts[found])
        self._free_starts[found].remove(start)
        while found > order:  # split: keep the lower half, free the upper half
            found -= 1
            self._free_starts[found].add(start + (1 << found))
        self._allocated_orders[start] = order
        self._num_requested_blocks[start] = num_blocks
        self.num_free_blocks -= 1 << order
        return start

    def free(self, start: int) -> None:
        """Returns the allocation at `start`, merging it with its free buddies."""
        order = self._allocated_orders.pop(start, None)
        if order is None:
            raise KeyError(f"block {start} does not start an allocation")
        del self._num_requested_blocks[start]
        self.num_free_blocks += 1 << order
        while order < self.max_order:
            buddy = start ^ (1 << order)
            if buddy not in self._free_starts[order]:
                break
            self._free_starts[order].remove(buddy)
            start = min(start, buddy)
            order += 1
        self._free_starts[order].add(start)

    def check_integrity(self) -> None:
        """Raises AssertionError unless free and allocated blocks tile [0, num_blocks) exactly."""
        owner = [False] * self.num_blocks
        ranges = [(s, k, True) for k, starts in enumerate(self._free_starts) for s in starts]
        ranges += [(s, k, False) for s, k in self._allocated_orders.items()]
        num_free = 0
        for start, order, is_free in ranges:
            size = 1 << order
            assert start % size == 0, f"block {start} of order {order} is misaligned"
            assert start + size <= self.num_blocks, f"block {start} of order {order} overflows"
            for block_id in range(start, start + size):
                assert not owner[block_id], f"block id {block_id} is covered twice"
                owner[block_id] = True
            if is_free:
                num_free += size
                buddy = start ^ size
                assert order == self.max_order or buddy not in self._free_starts[order], (
                    f"free buddies {start} and {buddy} of order {order} were not merged"
                )
        assert all(owner), "some block ids are neither free nor allocated"
        assert num_free == self.num_free_blocks, f"{num_free} free, counter says {self.num_free_blocks}"
        for start, order in self._allocated_orders.items():
            assert 1 <= self._num_requested_blocks[start] <= 1 << order
