"""A fixed pool of KV blocks: reference counts, a free queue, and the prefix-hash index.

The free queue is a doubly linked list threaded through the blocks themselves, so a cached-but-free
block (ref_cnt 0, still holding a prefix hash) can be taken out of the middle in O(1) when a new
request hits it:

    head ─► [plain freed blocks, reused first] … [cached blocks, least recently freed first] ◄─ tail

`allocate()` pops the head; a popped block that still has a hash is *evicted* (its index entry is
dropped). A freed block with a hash goes to the tail (LRU); one without a hash goes to the head,
since reusing it loses nothing. The GPU pool and the CPU swap pool are two instances.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, eq=False)
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None  # set once the block is full and computed (prefix caching)
    token_ids: tuple[int, ...] = ()  # its tokens, to confirm a hash hit
    serial: int = -1  # unique per registration; children confirm their parent by it
    parent_serial: int = -1  # serial of the previous block of the prefix it was computed after
    num_filled_slots: int = 0  # token slots written or about to be written
    prev: Block | None = None  # free-queue links (None when not in the queue)
    next: Block | None = None
    in_free_queue: bool = False


class BlockPool:
    def __init__(self, num_blocks: int):
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._head = Block(-1)  # sentinels
        self._tail = Block(-2)
        self._head.next = self._tail
        self._tail.prev = self._head
        self.num_free_blocks = 0
        self.num_cached_free_blocks = 0
        self.num_shared_refs = 0  # sum over blocks of max(ref_cnt - 1, 0): references saved by sharing
        self.cached: dict[int, Block] = {}  # block_hash -> block (ref_cnt 0 or not)
        self._next_serial = 0
        for block in self.blocks:
            self._push_tail(block)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    # ---- free queue ------------------------------------------------------------------------------
    def _push_tail(self, block: Block) -> None:
        last = self._tail.prev
        assert last is not None
        last.next = block
        block.prev = last
        block.next = self._tail
        self._tail.prev = block
        self._enter(block)

    def _push_head(self, block: Block) -> None:
        first = self._head.next
        assert first is not None
        first.prev = block
        block.next = first
        block.prev = self._head
        self._head.next = block
        self._enter(block)

    def _enter(self, block: Block) -> None:
        block.in_free_queue = True
        self.num_free_blocks += 1
        if block.block_hash is not None:
            self.num_cached_free_blocks += 1

    def _unlink(self, block: Block) -> None:
        prev, next_ = block.prev, block.next
        assert prev is not None and next_ is not None, f"block {block.block_id} is not in the free queue"
        prev.next = next_
        next_.prev = prev
        block.prev = block.next = None
        block.in_free_queue = False
        self.num_free_blocks -= 1
        if block.block_hash is not None:
            self.num_cached_free_blocks -= 1

    def free_block_ids(self) -> list[int]:
        """Free queue from head to tail (for tests and integrity checks)."""
        ids = []
        node = self._head.next
        while node is not None and node is not self._tail:
            ids.append(node.block_id)
            node = node.next
        return ids

    # ---- allocation --------------------------------------------------------------------------
    def allocate(self) -> Block:
        """Take the head of the free queue (evicting its cached prefix, if any); ref_cnt = 1."""
        block = self._head.next
        if block is None or block is self._tail:
            raise MemoryError("block pool exhausted")
        self._unlink(block)
        if block.block_hash is not None:
            self.uncache(block)
        block.ref_cnt = 1
        block.num_filled_slots = 0
        return block

    def touch(self, block: Block) -> None:
        """Add a reference; a cached-free block is revived (taken out of the free queue)."""
        if block.ref_cnt == 0:
            self._unlink(block)
        else:
            self.num_shared_refs += 1
        block.ref_cnt += 1

    def release(self, block: Block) -> None:
        """Drop a reference; at zero the block joins the free queue (tail if cached, else head)."""
        if block.ref_cnt <= 0:
            raise AssertionError(f"block {block.block_id} released with ref_cnt {block.ref_cnt}")
        block.ref_cnt -= 1
        if block.ref_cnt > 0:
            self.num_shared_refs -= 1
        else:
            if block.block_hash is None:
                self._push_head(block)
            else:
                self._push_tail(block)

    # ---- prefix-hash index -------------------------------------------------------------------
    def cache(self, block: Block, block_hash: int, token_ids: tuple[int, ...], parent_serial: int) -> bool:
        """Publish a full, computed block under `block_hash`; False if the hash is already taken."""
        if block.block_hash is not None or block_hash in self.cached:
            return False
        block.block_hash = block_hash
        block.token_ids = token_ids
        block.parent_serial = parent_serial
        block.serial = self._next_serial
        self._next_serial += 1
        self.cached[block_hash] = block
        if block.in_free_queue:
            self.num_cached_free_blocks += 1
        return True

    def uncache(self, block: Block) -> None:
        if block.in_free_queue:
            self.num_cached_free_blocks -= 1
        assert block.block_hash is not None, f"block {block.block_id} is not cached"
        del self.cached[block.block_hash]
        block.block_hash = None
        block.token_ids = ()
        block.serial = block.parent_serial = -1

    def lookup(self, block_hash: int, token_ids: tuple[int, ...], parent_serial: int) -> Block | None:
        """The cached block with this hash whose tokens AND parent match (a collision never hits)."""
        block = self.cached.get(block_hash)
        if block is None or block.parent_serial != parent_serial or block.token_ids != token_ids:
            return None
        return block

    def check_integrity(self) -> None:
        free_ids = self.free_block_ids()
        assert len(free_ids) == len(set(free_ids)) == self.num_free_blocks, "free queue count"
        for block_id in free_ids:
            block = self.blocks[block_id]
            assert block.ref_cnt == 0 and block.in_free_queue, f"block {block_id} free with refs"
        in_queue = sum(b.in_free_queue for b in self.blocks)
        assert in_queue == self.num_free_blocks, "in_free_queue flags"
        shared = sum(b.ref_cnt - 1 for b in self.blocks if b.ref_cnt > 1)
        assert shared == self.num_shared_refs, f"shared references {self.num_shared_refs} != {shared}"
        for block in self.blocks:
            assert block.ref_cnt >= 0
            assert block.in_free_queue == (block.ref_cnt == 0), f"block {block.block_id} free state"
        cached_free = sum(1 for b in self.blocks if b.in_free_queue and b.block_hash is not None)
        assert cached_free == self.num_cached_free_blocks, "cached-free count"
        for block_hash, block in self.cached.items():
            assert block.block_hash == block_hash, f"hash index of block {block.block_id}"
        assert sum(b.block_hash is not None for b in self.blocks) == len(self.cached), "stray hashes"
