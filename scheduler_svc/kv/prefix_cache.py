"""Automatic prefix caching over a BlockPool's hash index.

The hash of a full block is xxhash64(parent block hash, its token ids) (the parent hash is the
seed). A block is published only once it is full AND its KV is computed, so the last partial
block is never shared by a lookup. A hit must match the hash, the block's token ids, and the
`serial` of the previous block of the prefix (each publication gets a fresh serial), so a hash
collision never shares wrong data, not even through a collided parent:

    lookup:  h0 = H(ROOT, t[0:bs])   -> block with tokens t[0:bs], parent_serial -1
             h1 = H(h0, t[bs:2bs])   -> block with tokens t[bs:2bs], parent_serial = serial of hit 0
             ... stop at the first miss
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

import xxhash

from scheduler_svc.kv.block_pool import Block, BlockPool

ROOT_HASH = 0x9E3779B97F4A7C15


def hash_block_tokens(parent_hash: int, token_ids: list[int]) -> int:
    """Prefix hash of one full block (tests monkeypatch this to force collisions)."""
    return xxhash.xxh64_intdigest(array("q", token_ids).tobytes(), seed=parent_hash)


@dataclass(slots=True)
class SeqBlocks:
    """The BlockManager's state of one sequence: its block table and how far it is published."""

    block_table: list[int]  # GPU block ids, or CPU block ids while swapped out
    on_cpu: bool = False
    num_published_blocks: int = 0  # blocks [0, n) were offered to the prefix index
    parent_hash: int = ROOT_HASH  # hash of block n-1 (ROOT_HASH for n == 0)
    parent_serial: int = -1  # serial of the published block holding the same content as block n-1
    chain_broken: bool = False  # a hash collision stopped publication for this sequence
    # blocks [0, n) are shared with sequences that wait for this one to compute them (a group
    # recomputed after a preemption: BlockManager.allocate); writing into them copies nothing
    num_lead_blocks: int = 0


def lookup_prefix(pool: BlockPool, block_size: int, token_ids: list[int]) -> list[Block]:
    """Published blocks holding the longest prefix of token_ids, leaving >= 1 token to compute."""
    hits: list[Block] = []
    parent_hash, parent_serial = ROOT_HASH, -1
    for i in range((len(token_ids) - 1) // block_size):
        chunk = token_ids[i * block_size : (i + 1) * block_size]
        block_hash = hash_block_tokens(parent_hash, chunk)
        block = pool.lookup(block_hash, tuple(chunk), parent_serial)
        if block is None:
            break
        hits.append(block)
        parent_hash, parent_serial = block_hash, block.serial
    return hits


def publish_computed_blocks(
    pool: BlockPool, block_size: int, state: SeqBlocks, token_ids: list[int], num_computed_tokens: int
) -> None:
    """Publish the sequence's full blocks whose KV is computed, continuing where it stopped."""
    bs = block_size
    num_full = min(num_computed_tokens // bs, len(state.block_table))
    for i in range(state.num_published_blocks, num_full):
        block = pool.blocks[state.block_table[i]]
        if block.block_hash is not None:  # a prefix hit, or published through a forked sibling
            block_hash, serial = block.block_hash, block.serial
        else:
            chunk = token_ids[i * bs : (i + 1) * bs]
            block_hash = hash_block_tokens(state.parent_hash, chunk)
            content = tuple(chunk)
            same = pool.lookup(block_hash, content, state.parent_serial)
            if same is not None:  # identical content already published by another block
                serial = same.serial
            elif pool.cache(block, block_hash, content, state.parent_serial):
                serial = block.serial
            else:  # hash taken by different content: stop publishing this sequence
                state.chain_broken = True
                return
        state.parent_hash, state.parent_serial = block_hash, serial
        state.num_published_blocks = i + 1
