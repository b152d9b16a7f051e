"""The KV memory interface the Scheduler uses. Policies implement it:

- `scheduler_svc.kv.block_manager.BlockManager`: paged blocks, prefix caching, copy-on-write, swap;
- `scheduler_svc.kv.reservation`: contiguous reservation baselines (reserve-max / pow2 / oracle).

The scheduler is the single owner of memory decisions; a manager only answers and applies them.
Call protocol (what an implementation may rely on):

- A waiting group is admitted with `can_allocate` → `allocate`; `allocate` covers every WAITING
  sequence of the group (one sequence on first admission; all live ones after a recompute) and
  gives each room for all its `token_ids`, setting `seq.num_computed_tokens` to the prefix-cache
  hit length (always < `seq.num_tokens`, so at least one token is computed and gives logits).
- Before scheduling `k` tokens of a running sequence (positions `num_computed_tokens` ..
  `num_computed_tokens + k - 1`) the scheduler calls `append_slots(seq, k)`, after checking the whole
  group with `can_append_slots`. The scheduler then advances `seq.num_computed_tokens` itself.
- When a step's result arrives the scheduler calls `mark_computed(seq)`: the KV of the first
  `seq.num_computed_tokens` tokens is now real (a prefix cache may publish those full blocks).
- `fork(parent, child)` never needs memory; `free(seq)` releases everything of one sequence.
- Groups move whole: `swap_out` / `swap_in` take every live sequence of the group.

Memory a reservation policy wants to size from the output length may read
`group.sampling_params.max_tokens` and `group.expected_output_len` (true length, when known).
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Mapping

from scheduler_svc.request.sequence import Sequence, SequenceGroup

BlockPair = tuple[int, int]


class AllocStatus(enum.Enum):
    OK = "ok"  # can be allocated now
    LATER = "later"  # not enough free memory now; may fit once other requests finish
    NEVER = "never"  # can never fit, even in an empty cache (the request must be refused)


class KVCacheManager(abc.ABC):
    """Abstract KV-cache memory manager. Block ids index the executor's KV cache tensors."""

    block_size: int

    # ---- admission ---------------------------------------------------------------------------
    @abc.abstractmethod
    def can_allocate(self, group: SequenceGroup) -> AllocStatus:
        """Whether `allocate(group)` would succeed now (NEVER: not even in an empty cache)."""

    @abc.abstractmethod
    def allocate(self, group: SequenceGroup) -> None:
        """Give every WAITING sequence of `group` room for its token ids; set num_computed_tokens."""

    # ---- running -----------------------------------------------------------------------------
    @abc.abstractmethod
    def can_append_slots(self, group: SequenceGroup, num_new_tokens_by_seq: Mapping[int, int]) -> bool:
        """Whether `append_slots` can succeed for every (seq_id → num_new_tokens) of the group."""

    @abc.abstractmethod
    def append_slots(self, seq: Sequence, num_new_tokens: int) -> list[BlockPair]:
        """Make positions [num_computed_tokens, num_computed_tokens + num_new_tokens) writable.

        Returns copy-on-write pairs (src_block, dst_block) the executor must copy before the
        forward pass; each dst replaced an entry of the block table (paging: the one at index
        `seq.num_computed_tokens // block_size`; a reservation's fork: all of them). Every other
        change is an append.
        """

    @abc.abstractmethod
    def mark_computed(self, seq: Sequence) -> None:
        """The KV of the first `seq.num_computed_tokens` tokens is now computed (step finished)."""

    def append_decode_slots(self, groups: list[SequenceGroup]) -> tuple[int, dict[int, list[BlockPair]]]:
        """Fast path of the decode step: each group has one live sequence that computes one token.

        Appends one slot to each group's sequence in order and stops at the first that does not
        fit. Returns (number of groups served, {index in `groups`: copy-on-write pairs}). Policies
        may override it with a tighter loop; this default uses can_append_slots / append_slots.
        """
        copies: dict[int, list[BlockPair]] = {}
        for i, group in enumerate(groups):
            seq = group.seqs[0]
            if not self.can_append_slots(group, {seq.seq_id: 1}):
                return i, copies
            pairs = self.append_slots(seq, 1)
            if pairs:
                copies[i] = pairs
        return len(groups), copies

    def mark_computed_many(self, seqs: list[Sequence]) -> None:
        """`mark_computed` for every sequence of a finished step (overridable for speed)."""
        for seq in seqs:
            self.mark_computed(seq)

    @abc.abstractmethod
    def fork(self, parent: Sequence, child: Sequence) -> None:
        """`child` shares every block of `parent` (the child's token ids equal the parent's)."""

    @abc.abstractmethod
    def free(self, seq: Sequence) -> None:
        """Release every block of `seq` (on finish, abort, dropped beam, or recompute preemption)."""

    # ---- swapping ----------------------------------------------------------------------------
    @abc.abstractmethod
    def can_swap_out(self, group: SequenceGroup) -> bool:
        """Whether the CPU swap space can take the group's blocks now."""

    @abc.abstractmethod
    def swap_out(self, group: SequenceGroup) -> list[BlockPair]:
        """Move the group's KV to CPU; returns (gpu_block, cpu_block), each distinct block once."""

    @abc.abstractmethod
    def can_swap_in(self, group: SequenceGroup) -> bool:
        """Whether the GPU has room for the group's swapped blocks now, and for the group's next
        step (the scheduler swaps a group in only in a step that also schedules it)."""

    @abc.abstractmethod
    def swap_in(self, group: SequenceGroup) -> list[BlockPair]:
        """Move the group's KV back to GPU; returns (cpu_block, gpu_block), each distinct block once."""

    # ---- queries -----------------------------------------------------------------------------
    @abc.abstractmethod
    def block_table(self, seq: Sequence) -> list[int]:
        """The sequence's GPU block ids (the manager's own list: read it, do not modify it)."""

    @abc.abstractmethod
    def check_integrity(self) -> None:
        """Raise AssertionError if any internal invariant is broken (tests call it after each op)."""

    @abc.abstractmethod
    def clear_prefix_cache(self) -> None:
        """Forget every cached prefix (the executors lost the KV it names); held blocks stay."""

    @property
    @abc.abstractmethod
    def policy_name(self) -> str:
        """The policy's name as `--kv-policy` spells it ("paged", "reserve-max", ...)."""

    @property
    @abc.abstractmethod
    def num_total_blocks(self) -> int:
        """GPU blocks in the pool."""

    @property
    @abc.abstractmethod
    def num_free_blocks(self) -> int:
        """GPU blocks with no reference (including cached-free ones, which can be reused)."""

    @property
    @abc.abstractmethod
    def num_free_cpu_blocks(self) -> int:
        """CPU swap blocks with no reference (0 for policies that do not swap)."""

    @property
    def num_used_blocks(self) -> int:
        return self.num_total_blocks - self.num_free_blocks

    @property
    def num_cached_free_blocks(self) -> int:
        """Free GPU blocks that still hold a findable prefix (0 for policies without a cache)."""
        return 0

    @property
    def num_shared_block_refs(self) -> int:
        """Blocks saved by sharing: sum over used GPU blocks of (ref_cnt - 1)."""
        return 0

    @property
    @abc.abstractmethod
    def num_allocated_slots(self) -> int:
        """KV token slots allocated or reserved on GPU (used blocks × block_size for paging)."""

    @property
    @abc.abstractmethod
    def num_filled_slots(self) -> int:
        """Allocated GPU slots that hold (or are about to hold) a real token; a shared slot counts once.

        kv_utilization = num_filled_slots / num_allocated_slots.
        """

    @property
    def num_prefix_query_tokens(self) -> int:
        """Prompt tokens looked up in the prefix cache so far."""
        return 0

    @property
    def num_prefix_hit_tokens(self) -> int:
        """Prompt tokens found in the prefix cache so far."""
        return 0
