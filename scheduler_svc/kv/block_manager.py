"""The paged KV policy: block tables over a GPU pool and a CPU swap pool, with automatic prefix
caching (prefix_cache.py), copy-on-write and whole-group swapping (vLLM paper §4.2–4.5).

A sequence's blocks are all allocated when it is admitted (room for every known token); decoding
appends one block at each block boundary. Writing into a block shared with another sequence
(after a fork) first copies it (copy-on-write). Full blocks are published for prefix sharing
once computed (`mark_computed`); freed ones stay findable until evicted in LRU order.
"""

from __future__ import annotations

from collections.abc import Mapping

from scheduler_svc.kv.block_pool import Block, BlockPool
from scheduler_svc.kv.kv_manager import AllocStatus, BlockPair, KVCacheManager
from scheduler_svc.kv.prefix_cache import ROOT_HASH, SeqBlocks, lookup_prefix, publish_computed_blocks
from scheduler_svc.request.sequence import Sequence, SequenceGroup, SequenceStatus


class BlockManager(KVCacheManager):
    def __init__(
        self,
        block_size: int,
        num_gpu_blocks: int,
        num_cpu_blocks: int = 0,
        enable_prefix_caching: bool = True,
        watermark_blocks: int = 0,
    ):
        if block_size < 1 or num_gpu_blocks < 1 or num_cpu_blocks < 0:
            raise ValueError("block_size and num_gpu_blocks must be >= 1, num_cpu_blocks >= 0")
        self.block_size = block_size
        self.gpu = BlockPool(num_gpu_blocks)
        self.cpu = BlockPool(num_cpu_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self.watermark_blocks = watermark_blocks
        self._seqs: dict[int, SeqBlocks] = {}
        self._num_filled_slots = 0  # over GPU blocks with ref_cnt > 0
        self._num_prefix_query_tokens = 0
        self._num_prefix_hit_tokens = 0

    # ---- counters ------------------------------------------------------------------------------
    @property
    def num_total_blocks(self) -> int:
        return self.gpu.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.gpu.num_free_blocks

    @property
    def num_free_cpu_blocks(self) -> int:
        return self.cpu.num_free_blocks

    @property
    def num_cached_free_blocks(self) -> int:
        return self.gpu.num_cached_free_blocks

    @property
    def num_shared_block_refs(self) -> int:
        return self.gpu.num_shared_refs

    @property
    def num_allocated_slots(self) -> int:
        return self.num_used_blocks * self.block_size

    @property
    def num_filled_slots(self) -> int:
        return self._num_filled_slots

    @property
    def num_prefix_query_tokens(self) -> int:
        return self._num_prefix_query_tokens

    @property
    def num_prefix_hit_tokens(self) -> int:
        return self._num_prefix_hit_tokens

    @property
    def policy_name(self) -> str:
        return "paged"

    def block_table(self, seq: Sequence) -> list[int]:
        return self._seqs[seq.seq_id].block_table

    def clear_prefix_cache(self) -> None:
        for pool in (self.gpu, self.cpu):
            for block in list(pool.cached.values()):
                pool.uncache(block)

    # ---- GPU block references (keep num_filled_slots exact) ----------------------------------------
    def _new_block(self, num_filled_slots: int) -> Block:
        block = self.gpu.allocate()
        block.num_filled_slots = num_filled_slots
        self._num_filled_slots += num_filled_slots
        return block

    def _share(self, block: Block) -> None:
        if block.ref_cnt == 0:
            self._num_filled_slots += block.num_filled_slots
        self.gpu.touch(block)

    def _release(self, block: Block) -> None:
        self.gpu.release(block)
        if block.ref_cnt == 0:
            self._num_filled_slots -= block.num_filled_slots

    # ---- admission -----------------------------------------------------------------------------
    def _num_blocks(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _lookup_prefix(self, token_ids: list[int]) -> list[Block]:
        """Cached blocks holding the longest prefix of token_ids, leaving >= 1 token to compute."""
        if not self.enable_prefix_caching:
            return []
        return lookup_prefix(self.gpu, self.block_size, token_ids)

    def _shared_with_leader(self, waiting: list[Sequence]) -> list[int]:
        """Blocks each waiting sequence takes from the group's first one (its leader) instead of its
        own: the full blocks at the head of both that hold the same tokens, leaving both at least one
        token to compute, as a prefix lookup does (so a hit of either there is a hit of both; 0 for
        the leader). Several sequences wait together only after a recompute preemption: n samples
        or beams with one prompt, which a fork had shared; without this each would prefill its own
        copy of the prompt, and a group that fitted while it ran could need more than the whole
        cache to come back."""
        if len(waiting) < 2:
            return [0] * len(waiting)
        bs = self.block_size
        leader = waiting[0].token_ids
        shared = [0]
        for seq in waiting[1:]:
            tokens = seq.token_ids
            limit = (min(len(leader), len(tokens)) - 1) // bs
            n = 0
            while n < limit and leader[n * bs : (n + 1) * bs] == tokens[n * bs : (n + 1) * bs]:
                n += 1
            shared.append(n)
        return shared

    def can_allocate(self, group: SequenceGroup) -> AllocStatus:
        waiting = group.seqs_with_status(SequenceStatus.WAITING)
        needs = [self._num_blocks(s.num_tokens) for s in waiting]
        if max(needs, default=0) > self.num_total_blocks - self.watermark_blocks:
            return AllocStatus.NEVER
        shared = self._shared_with_leader(waiting)
        num_needed = sum(needs) - sum(shared)
        if self.num_free_blocks - num_needed >= self.watermark_blocks:
            return AllocStatus.OK
        # A prefix hit costs no free block when the block is in use, or when another of the group's
        # sequences hits it too (allocate shares it: the samples of a group recomputed after a
        # preemption have the same prompt blocks); a cached block nobody uses costs one, once. A
        # sequence's hits among the blocks it shares with the leader are the leader's hits there.
        counted: set[int] = set()
        for seq, num_shared in zip(waiting, shared, strict=True):
            for block in self._lookup_prefix(seq.token_ids)[num_shared:]:
                if block.ref_cnt > 0 or block.block_id in counted:
                    num_needed -= 1
                counted.add(block.block_id)
        ok = self.num_free_blocks - num_needed >= self.watermark_blocks
        return AllocStatus.OK if ok else AllocStatus.LATER

    def allocate(self, group: SequenceGroup) -> None:
        bs = self.block_size
        waiting = group.seqs_with_status(SequenceStatus.WAITING)
        shared = self._shared_with_leader(waiting)
        # Every sequence's prefix hits are taken before any new block: a new block comes from the
        # head of the free queue and may evict a cached block, which must not be one that a later
        # sequence of the group hits (can_allocate counted it once for all of them).
        hits_of = []
        for seq in waiting:
            assert seq.seq_id not in self._seqs, f"seq {seq.seq_id} already has blocks"
            hits = self._lookup_prefix(seq.token_ids)
            for block in hits:
                self._share(block)
            hits_of.append(hits)
        leader_table: list[int] = []
        for seq, hits, num_shared in zip(waiting, hits_of, shared, strict=True):
            num_tokens = seq.num_tokens
            table = [b.block_id for b in hits]
            # Past its hits, a sequence shares the leader's blocks of the same tokens; the leader
            # computes them, and the sequence computes its own tokens only once it has (waits_for).
            for block_id in leader_table[len(hits) : num_shared]:
                self._share(self.gpu.blocks[block_id])
                table.append(block_id)
            for i in range(len(table), self._num_blocks(num_tokens)):
                table.append(self._new_block(min(bs, num_tokens - i * bs)).block_id)
            state = SeqBlocks(table, num_published_blocks=len(hits))
            if not leader_table:
                leader_table = table
                state.num_lead_blocks = max(shared)
            if hits:
                last_hit = hits[-1]
                assert last_hit.block_hash is not None  # a hit is a cached block
                state.parent_hash, state.parent_serial = last_hit.block_hash, last_hit.serial
            self._seqs[seq.seq_id] = state
            seq.num_computed_tokens = max(len(hits), num_shared) * bs
            seq.waits_for = waiting[0] if num_shared > len(hits) else None
            if self.enable_prefix_caching:
                self._num_prefix_query_tokens += num_tokens
                self._num_prefix_hit_tokens += len(hits) * bs
        if group.num_cached_prompt_tokens is None and hits_of:  # its first admission (not a recompute)
            group.num_cached_prompt_tokens = min(len(hits_of[0]) * bs, group.prompt_len)

    # ---- running -------------------------------------------------------------------------------
    def _num_append_blocks(self, seq: Sequence, num_new_tokens: int) -> int:
        state = self._seqs[seq.seq_id]
        table = state.block_table
        num_needed = self._num_blocks(seq.num_computed_tokens + num_new_tokens) - len(table)
        idx = seq.num_computed_tokens // self.block_size
        if state.num_lead_blocks <= idx < len(table) and self.gpu.blocks[table[idx]].ref_cnt > 1:
            num_needed += 1  # copy-on-write
        return max(num_needed, 0) if num_new_tokens else 0

    def can_append_slots(self, group: SequenceGroup, num_new_tokens_by_seq: Mapping[int, int]) -> bool:
        num_needed = sum(
            self._num_append_blocks(s, num_new_tokens_by_seq[s.seq_id])
            for s in group.seqs
            if s.seq_id in num_new_tokens_by_seq
        )
        return num_needed <= self.num_free_blocks

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> list[BlockPair]:
        if num_new_tokens <= 0:
            return []
        bs = self.block_size
        state = self._seqs[seq.seq_id]
        table = state.block_table
        start = seq.num_computed_tokens
        end = start + num_new_tokens
        idx = start // bs
        copies: list[BlockPair] = []
        blocks = self.gpu.blocks
        if idx < len(table):
            block = blocks[table[idx]]
            # copy-on-write: the block we write into is shared (unless the sharers wait for this
            # sequence to fill it with the same tokens)
            if block.ref_cnt > 1 and idx >= state.num_lead_blocks:
                new = self._new_block(block.num_filled_slots)
                self._release(block)
                table[idx] = new.block_id
                copies.append((block.block_id, new.block_id))
                block = new
            filled = min(bs, end - idx * bs)
            if filled > block.num_filled_slots:
                self._num_filled_slots += filled - block.num_filled_slots
                block.num_filled_slots = filled
        for i in range(len(table), self._num_blocks(end)):
            table.append(self._new_block(min(bs, end - i * bs)).block_id)
        return copies

    def append_decode_slots(self, groups: list[SequenceGroup]) -> tuple[int, dict[int, list[BlockPair]]]:
        bs, blocks, states, pool = self.block_size, self.gpu.blocks, self._seqs, self.gpu
        copies: dict[int, list[BlockPair]] = {}
        for i, group in enumerate(groups):
            seq = group.seqs[0]
            table = states[seq.seq_id].block_table
            pos = seq.num_computed_tokens
            idx = pos // bs
            if idx >= len(table):  # first token of a new block
                if pool.num_free_blocks == 0:
                    return i, copies
                table.append(self._new_block(1).block_id)
                continue
            block = blocks[table[idx]]
            if block.ref_cnt > 1:
                if pool.num_free_blocks == 0:
                    return i, copies
                copies[i] = self.append_slots(seq, 1)
                continue
            filled = pos - idx * bs + 1
            if filled > block.num_filled_slots:
                self._num_filled_slots += filled - block.num_filled_slots
                block.num_filled_slots = filled
        return len(groups), copies

    def mark_computed_many(self, seqs: list[Sequence]) -> None:
        if not self.enable_prefix_caching:
            return
        bs, states = self.block_size, self._seqs
        for seq in seqs:
            state = states.get(seq.seq_id)
            known = min(seq.num_computed_tokens, len(seq.token_ids) - seq.pending)
            if state is not None and known // bs > state.num_published_blocks:
                self.mark_computed(seq)

    def mark_computed(self, seq: Sequence) -> None:
        if not self.enable_prefix_caching:
            return
        state = self._seqs.get(seq.seq_id)
        if state is not None and not state.on_cpu and not state.chain_broken:
            # tokens still being sampled (placeholders) are in no published block
            known = min(seq.num_computed_tokens, len(seq.token_ids) - seq.pending)
            publish_computed_blocks(self.gpu, self.block_size, state, seq.token_ids, known)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        src = self._seqs[parent.seq_id]
        assert child.seq_id not in self._seqs, f"seq {child.seq_id} already has blocks"
        pool = self.cpu if src.on_cpu else self.gpu
        for block_id in src.block_table:
            if src.on_cpu:
                pool.touch(pool.blocks[block_id])
            else:
                self._share(pool.blocks[block_id])
        self._seqs[child.seq_id] = SeqBlocks(
            list(src.block_table),
            on_cpu=src.on_cpu,
            num_published_blocks=src.num_published_blocks,
            parent_hash=src.parent_hash,
            parent_serial=src.parent_serial,
            chain_broken=src.chain_broken,
        )

    def free(self, seq: Sequence) -> None:
        state = self._seqs.pop(seq.seq_id, None)
        if state is None:
            return
        # Reverse order: the tail of a prefix is evicted before its head.
        if state.on_cpu:
            for block_id in reversed(state.block_table):
                self.cpu.release(self.cpu.blocks[block_id])
        else:
            for block_id in reversed(state.block_table):
                self._release(self.gpu.blocks[block_id])

    def has_blocks(self, seq: Sequence) -> bool:
        return seq.seq_id in self._seqs

    # ---- swapping ------------------------------------------------------------------------------
    def _distinct_blocks(self, group: SequenceGroup) -> int:
        tables = [self._seqs[s.seq_id].block_table for s in group.seqs if s.seq_id in self._seqs]
        return len({b for table in tables for b in table})

    def can_swap_out(self, group: SequenceGroup) -> bool:
        return self._distinct_blocks(group) <= self.cpu.num_free_blocks

    def can_swap_in(self, group: SequenceGroup) -> bool:
        # One more block per sequence, so the group can also be scheduled in the swap-in step.
        num_needed = self._distinct_blocks(group) + len(group.seqs)
        return num_needed <= self.num_free_blocks - self.watermark_blocks

    def swap_out(self, group: SequenceGroup) -> list[BlockPair]:
        return self._move(group, to_cpu=True)

    def swap_in(self, group: SequenceGroup) -> list[BlockPair]:
        return self._move(group, to_cpu=False)

    def _move(self, group: SequenceGroup, to_cpu: bool) -> list[BlockPair]:
        """Move every live sequence of the group; a block shared within the group is moved once."""
        src_pool, dst_pool = (self.gpu, self.cpu) if to_cpu else (self.cpu, self.gpu)
        mapping: dict[int, Block] = {}
        pairs: list[BlockPair] = []
        for seq in group.seqs:
            state = self._seqs.get(seq.seq_id)
            if state is None:
                continue
            assert state.on_cpu != to_cpu, f"seq {seq.seq_id} is already on that side"
            new_table = []
            for block_id in state.block_table:
                src = src_pool.blocks[block_id]
                dst = mapping.get(block_id)
                if dst is None:
                    dst = dst_pool.allocate() if to_cpu else self._new_block(src.num_filled_slots)
                    dst.num_filled_slots = src.num_filled_slots
                    mapping[block_id] = dst
                    pairs.append((block_id, dst.block_id))
                elif to_cpu:
                    dst_pool.touch(dst)
                else:
                    self._share(dst)
                new_table.append(dst.block_id)
            for block_id in reversed(state.block_table):
                if to_cpu:
                    self._release(src_pool.blocks[block_id])
                else:
                    src_pool.release(src_pool.blocks[block_id])
            state.block_table = new_table
            state.on_cpu = to_cpu
            if not to_cpu:  # new GPU blocks are unpublished: offer them again from block 0
                state.num_published_blocks, state.parent_hash, state.parent_serial = 0, ROOT_HASH, -1
        return pairs

    # ---- invariants ----------------------------------------------------------------------------
    def check_integrity(self) -> None:
        self.gpu.check_integrity()
        self.cpu.check_integrity()
        gpu_refs = [0] * self.gpu.num_blocks
        cpu_refs = [0] * self.cpu.num_blocks
        for seq_id, state in self._seqs.items():
            refs = cpu_refs if state.on_cpu else gpu_refs
            for block_id in state.block_table:
                refs[block_id] += 1
            assert state.num_published_blocks <= len(state.block_table), f"seq {seq_id} published"
        for pool, refs in ((self.gpu, gpu_refs), (self.cpu, cpu_refs)):
            for block in pool.blocks:
                assert block.ref_cnt == refs[block.block_id], (
                    f"block {block.block_id}: ref_cnt {block.ref_cnt} != {refs[block.block_id]} table refs"
                )
        used = sum(1 for r in gpu_refs if r)
        assert used + self.gpu.num_free_blocks == self.gpu.num_blocks, "free + used != total"
        filled = sum(b.num_filled_slots for b in self.gpu.blocks if b.ref_cnt > 0)
        assert filled == self._num_filled_slots, f"filled slots {self._num_filled_slots} != {filled}"
        for block in self.gpu.blocks:
            if block.block_hash is not None:
                assert len(block.token_ids) == self.block_size, f"block {block.block_id} hashed not full"
        assert not self.cpu.cached, "CPU blocks are never published"
