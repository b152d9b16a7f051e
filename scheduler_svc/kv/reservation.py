"""Contiguous-reservation KV policies: the paper's Orca-style baselines (§6), on the same KV budget
as the paged policy.

Every sequence owns ONE contiguous range of blocks from a buddy allocator (`buddy.py`), sized at
admission for its whole future:

    reserve-max     max_model_len slots (e.g. 2048 for the llama2-13b / OPT-13B setting)
    reserve-pow2    prompt + the true output length rounded up to a power of two (at most 2x over-
                    reservation of the output, as the paper's Orca (Pow2)), capped at max_model_len
    reserve-oracle  prompt + the true output length

"True output length" is `group.expected_output_len` when known, else `sampling_params.max_tokens`.
The buddy allocator then rounds each range up to a power of two blocks. Nothing is shared: no
prefix caching, and a group with n samples or beam width k reserves n (or k) ranges at admission,
so that `fork` (which never needs memory, see kv_manager.py) takes a range reserved for it and the
child's KV is copied from its parent's blocks. A running sequence never needs a new block, so these
policies never preempt for growth; swapping is not supported (`can_swap_out` is False, so the
scheduler falls back to recompute when it preempts at all).

Counters follow kv_manager.py: `num_allocated_slots` counts every held buddy block (rounding and
reserved-but-unused slots included); `num_filled_slots` counts the slots that hold or are about to
hold a token.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field

from scheduler_svc.kv.buddy import BuddyAllocator
from scheduler_svc.kv.kv_manager import AllocStatus, BlockPair, KVCacheManager
from scheduler_svc.request.sequence import Sequence, SequenceGroup, SequenceStatus


class ReservationPolicy(enum.StrEnum):
    MAX = "reserve-max"
    POW2 = "reserve-pow2"
    ORACLE = "reserve-oracle"


def next_pow2(value: int) -> int:
    return 1 << max(0, value - 1).bit_length()


@dataclass(slots=True)
class _GroupRanges:
    """Ranges of one request: the ones held by live sequences, and spares reserved for forks."""

    group: SequenceGroup
    num_seq_ranges: int = 0
    spare_starts: list[int] = field(default_factory=list)


@dataclass(slots=True)
class _SeqRange:
    start: int  # first block of the buddy allocation
    block_table: list[int]  # the first blocks of the range, as many as the tokens need
    num_filled_slots: int
    ranges: _GroupRanges
    pending_copies: list[BlockPair] = field(default_factory=list)  # parent -> child after a fork


class ReservationManager(KVCacheManager):
    def __init__(
        self, policy: ReservationPolicy | str, block_size: int, num_gpu_blocks: int, max_model_len: int
    ):
        if block_size < 1 or num_gpu_blocks < 1 or max_model_len < 1:
            raise ValueError("block_size, num_gpu_blocks and max_model_len must be >= 1")
        self.policy = ReservationPolicy(policy)
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.buddy = BuddyAllocator(num_gpu_blocks)
        self._seqs: dict[int, _SeqRange] = {}
        self._groups: dict[str, _GroupRanges] = {}
        self._num_filled_slots = 0

    # ---- sizing --------------------------------------------------------------------------------
    def reserved_tokens(self, group: SequenceGroup) -> int:
        """Token slots one sequence of `group` reserves (before the buddy's rounding)."""
        params = group.sampling_params
        output_len = params.max_tokens if group.expected_output_len is None else group.expected_output_len
        exact = group.prompt_len + output_len
        if self.policy is ReservationPolicy.MAX:
            return max(self.max_model_len, exact)
        if self.policy is ReservationPolicy.POW2:
            return max(exact, min(group.prompt_len + next_pow2(output_len), self.max_model_len))
        return exact

    def _num_range_blocks(self, group: SequenceGroup) -> int:
        return -(-self.reserved_tokens(group) // self.block_size)

    @staticmethod
    def _num_ranges(group: SequenceGroup) -> int:
        """Ranges to reserve now: the waiting sequences plus the forks still to come."""
        params = group.sampling_params
        num = len(group.seqs_with_status(SequenceStatus.WAITING))
        if params.n > 1 and not group.samples_forked:
            num += params.n - len(group.seqs)
        if group.beam is not None or params.use_beam_search:
            num = max(num, params.beam_width)
        return num

    # ---- admission -----------------------------------------------------------------------------
    def can_allocate(self, group: SequenceGroup) -> AllocStatus:
        num_blocks, num_ranges = self._num_range_blocks(group), self._num_ranges(group)
        if self.buddy.num_allocatable_when_empty(num_blocks) < num_ranges:
            return AllocStatus.NEVER
        if self.buddy.num_allocatable(num_blocks) >= num_ranges:
            return AllocStatus.OK
        return AllocStatus.LATER

    def allocate(self, group: SequenceGroup) -> None:
        num_blocks = self._num_range_blocks(group)
        ranges = self._groups.get(group.request_id)
        if ranges is None:
            ranges = self._groups[group.request_id] = _GroupRanges(group)
        waiting = group.seqs_with_status(SequenceStatus.WAITING)
        num_spares = self._num_ranges(group) - len(waiting)
        for seq in waiting:
            assert seq.seq_id not in self._seqs, f"seq {seq.seq_id} already has a range"
            start = self.buddy.allocate(num_blocks)
            table = list(range(start, start + -(-seq.num_tokens // self.block_size)))
            self._seqs[seq.seq_id] = _SeqRange(start, table, seq.num_tokens, ranges)
            ranges.num_seq_ranges += 1
            self._num_filled_slots += seq.num_tokens
            seq.num_computed_tokens = 0
        for _ in range(num_spares):
            ranges.spare_starts.append(self.buddy.allocate(num_blocks))

    # ---- running -------------------------------------------------------------------------------
    def _fits(self, seq: Sequence, num_new_tokens: int) -> bool:
        state = self._seqs[seq.seq_id]
        capacity_slots = self.buddy.size_of(state.start) * self.block_size
        return seq.num_computed_tokens + num_new_tokens <= capacity_slots

    def can_append_slots(self, group: SequenceGroup, num_new_tokens_by_seq: Mapping[int, int]) -> bool:
        return all(
            self._fits(seq, num_new_tokens_by_seq[seq.seq_id])
            for seq in group.seqs
            if seq.seq_id in num_new_tokens_by_seq
        )

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> list[BlockPair]:
        """Grows the block table inside the sequence's own range. A freshly forked child first gets
        the copies of its parent's blocks: its whole table differs from the parent's, so the copies
        replace entries from block 0 on (and the plan sends the child's table again from there)."""
        state = self._seqs[seq.seq_id]
        if not self._fits(seq, num_new_tokens):
            raise MemoryError(f"seq {seq.seq_id} outgrew its reservation")
        copies, state.pending_copies = state.pending_copies, []
        end = seq.num_computed_tokens + num_new_tokens
        num_blocks = -(-end // self.block_size)
        table = state.block_table
        if num_blocks > len(table):
            table.extend(range(state.start + len(table), state.start + num_blocks))
        if end > state.num_filled_slots:
            self._num_filled_slots += end - state.num_filled_slots
            state.num_filled_slots = end
        return copies

    def mark_computed(self, seq: Sequence) -> None:
        return None  # no prefix cache

    def fork(self, parent: Sequence, child: Sequence) -> None:
        src = self._seqs[parent.seq_id]
        assert child.seq_id not in self._seqs, f"seq {child.seq_id} already has a range"
        ranges = src.ranges
        if not ranges.spare_starts:
            raise MemoryError(f"no range reserved for a fork of seq {parent.seq_id}")
        start = ranges.spare_starts.pop(0)
        table = list(range(start, start + len(src.block_table)))
        state = _SeqRange(
            start, table, src.num_filled_slots, ranges, list(zip(src.block_table, table, strict=True))
        )
        self._seqs[child.seq_id] = state
        ranges.num_seq_ranges += 1
        self._num_filled_slots += src.num_filled_slots

    def free(self, seq: Sequence) -> None:
        """A freed range of a beam-search group stays reserved for the group's next forks; the last
        sequence of a group to go releases everything the group holds."""
        state = self._seqs.pop(seq.seq_id, None)
        if state is None:
            return
        self._num_filled_slots -= state.num_filled_slots
        ranges = state.ranges
        ranges.num_seq_ranges -= 1
        group = ranges.group
        if ranges.num_seq_ranges > 0 and group.beam is not None and not group.is_finished:
            ranges.spare_starts.append(state.start)
            return
        self.buddy.free(state.start)
        if ranges.num_seq_ranges == 0:
            for start in ranges.spare_starts:
                self.buddy.free(start)
            del self._groups[group.request_id]

    # ---- swapping: not supported ------------------------------------------------------------------
    def can_swap_out(self, group: SequenceGroup) -> bool:
        return False

    def swap_out(self, group: SequenceGroup) -> list[BlockPair]:
        raise NotImplementedError("contiguous reservation policies do not swap")

    def can_swap_in(self, group: SequenceGroup) -> bool:
        return False

    def swap_in(self, group: SequenceGroup) -> list[BlockPair]:
        raise NotImplementedError("contiguous reservation policies do not swap")

    # ---- queries -------------------------------------------------------------------------------
    def block_table(self, seq: Sequence) -> list[int]:
        return self._seqs[seq.seq_id].block_table

    @property
    def num_total_blocks(self) -> int:
        return self.buddy.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.buddy.num_free_blocks

    @property
    def num_free_cpu_blocks(self) -> int:
        return 0

    @property
    def policy_name(self) -> str:
        return self.policy.value

    def clear_prefix_cache(self) -> None:
        return None  # no prefix cache

    @property
    def num_allocated_slots(self) -> int:
        return self.buddy.num_allocated_blocks * self.block_size

    @property
    def num_filled_slots(self) -> int:
        return self._num_filled_slots

    def check_integrity(self) -> None:
        self.buddy.check_integrity()
        starts = [s.start for s in self._seqs.values()]
        starts += [start for r in self._groups.values() for start in r.spare_starts]
        assert len(starts) == len(set(starts)) == self.buddy.num_allocations, "ranges != buddy allocations"
        for seq_id, state in self._seqs.items():
            size = self.buddy.size_of(state.start)
            assert state.block_table == list(range(state.start, state.start + len(state.block_table)))
            assert len(state.block_table) <= size, f"seq {seq_id} overflows its range"
            assert state.num_filled_slots <= len(state.block_table) * self.block_size
            assert state.ranges is self._groups[state.ranges.group.request_id]
        for ranges in self._groups.values():
            live = sum(1 for s in self._seqs.values() if s.ranges is ranges)
            assert live == ranges.num_seq_ranges > 0, f"group {ranges.group.request_id} range count"
        filled = sum(s.num_filled_slots for s in self._seqs.values())
        assert filled == self._num_filled_slots, f"filled slots {self._num_filled_slots} != {filled}"
