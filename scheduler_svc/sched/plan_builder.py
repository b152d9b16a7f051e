"""The executor mirror and the plan entries written from it.

Every executor rank holds state for the sequences it was sent (token ids, block table, computed
count; wire/step_plan.py says how it applies a plan). `PlanBuilder` is the one owner of what the
scheduler knows of that state, and the one writer of the plan entries that bring it up to date:

    per sequence   seq.executor_num_tokens   -1: the executors hold nothing, the next entry is a
                                             NewSequence; else how many token ids they hold
                   seq.executor_num_blocks   how long a prefix of the block table they hold right;
                                             entries from there on are sent again
    across them    forks not sent yet (child -> parent), ids whose state the executors must drop

The two per-sequence numbers live on the Sequence (one attribute read each on the hot path); no
other code reads or writes them. A scheduled sequence gets exactly one entry:

    executors hold nothing                                         -> NewSequence (all tokens, table)
    one token, the one appended since, table unchanged             -> the decode columns
    anything else (new block, copy-on-write, swap-in, prefill chunk) -> ContinuingSequence (the diff)
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from scheduler_svc.kv.kv_manager import BlockPair, KVCacheManager
from scheduler_svc.request.sequence import Sequence, SequenceGroup
from scheduler_svc.wire.step_plan import ContinuingSequence, NewSequence, StepPlan


def first_replaced_index(table: list[int], copies: list[BlockPair]) -> int:
    """The first table entry that copy-on-write replaced (each copy's destination is in the table)."""
    return min(table.index(dst) for _, dst in copies)


class PlanBuilder:
    def __init__(self, kv: KVCacheManager):
        self.kv = kv
        self.plan = StepPlan(0)  # the plan being built (between begin and end)
        self._finished_ids: list[int] = []  # executor state to drop, sent with the next plan
        self._pending_forks: dict[int, tuple[Sequence, Sequence]] = {}  # child id -> (child, parent)

    # ---- one plan --------------------------------------------------------------------------------
    def begin(self, step_id: int) -> None:
        self.plan = StepPlan(step_id)

    def end(self) -> StepPlan:
        """The plan, with the forks and finished ids gathered since the last one."""
        plan = self.plan
        plan.finished_seq_ids = self._finished_ids
        self._finished_ids = []
        plan.forks = [(child.seq_id, parent.seq_id) for child, parent in self._pending_forks.values()]
        self._pending_forks.clear()
        return plan

    def add(
        self,
        seqs: list[Sequence],
        num_new_tokens: Iterable[int],
        groups: Iterable[SequenceGroup],
        copies: Mapping[int, list[BlockPair]],
    ) -> None:
        """The entries that compute `num_new_tokens[i]` tokens of `seqs[i]` (a sequence of
        `groups[i]`) from its `num_computed_tokens` on, which this advances. `copies[i]`: the
        copy-on-write pairs the KV manager made in seqs[i]'s table for this step (the table is
        then sent again from the first replaced entry). `num_new_tokens` and `groups` may be
        iterators longer than `seqs` (itertools.repeat)."""
        plan, block_table = self.plan, self.kv.block_table
        step_id = plan.step_id
        new_append, cont_append = plan.new_seqs.append, plan.cont_seqs.append
        decode_ids_append, decode_tokens_append = plan.decode_seq_ids.append, plan.decode_token_ids.append
        for i, (seq, num_new, group) in enumerate(zip(seqs, num_new_tokens, groups, strict=False)):
            table = block_table(seq)
            if copies and i in copies:
                plan.copies.extend(copies[i])
                seq.executor_num_blocks = min(seq.executor_num_blocks, first_replaced_index(table, copies[i]))
            token_ids = seq.token_ids
            num_tokens = len(token_ids)
            num_held = seq.executor_num_tokens
            if num_held < 0:
                new_append(
                    NewSequence(
                        seq.seq_id,
                        list(token_ids),
                        seq.num_computed_tokens,
                        num_new,
                        list(table),
                        group.sampling_params,
                        seq.sample_index,
                        seq.prompt_len,
                    )
                )
            elif (num_new == 1 and num_held == num_tokens - 1 == seq.num_computed_tokens
                  and seq.executor_num_blocks == len(table)):
                decode_ids_append(seq.seq_id)
                decode_tokens_append(token_ids[-1])
            else:
                start = seq.executor_num_blocks
                cont_append(
                    ContinuingSequence(seq.seq_id, num_new, token_ids[num_held:], start, table[start:])
                )
            seq.executor_num_tokens = num_tokens
            seq.executor_num_blocks = len(table)
            seq.num_computed_tokens += num_new
            seq.scheduled_step = step_id

    def swap_out(self, group: SequenceGroup, pairs: list[BlockPair]) -> None:
        """The group's blocks go to CPU; its swap-in will send each whole new table."""
        self.plan.swap_out.extend(pairs)
        for seq in group.seqs:
            seq.executor_num_blocks = 0

    def swap_in(self, pairs: list[BlockPair]) -> None:
        self.plan.swap_in.extend(pairs)

    # ---- sequences coming and going ------------------------------------------------------------------
    def fork(self, child: Sequence, parent: Sequence) -> None:
        """`child` was forked from `parent`: the executors copy the parent's state, if they hold it."""
        if parent.executor_num_tokens >= 0:
            child.executor_num_tokens = parent.executor_num_tokens
            child.executor_num_blocks = parent.executor_num_blocks
            self._pending_forks[child.seq_id] = (child, parent)

    def forget(self, seq: Sequence) -> None:
        """The executors drop `seq` (finished, aborted, or preempted by recompute: it would come back
        as a NewSequence). A fork not sent yet is simply not sent."""
        if self._pending_forks.pop(seq.seq_id, None) is None and seq.executor_num_tokens >= 0:
            self._finished_ids.append(seq.seq_id)
        seq.executor_num_tokens = -1
        seq.executor_num_blocks = 0

    def reset(self) -> None:
        """The executors were reset (they hold nothing): nothing to drop or fork. Every live sequence
        was forgotten first (recompute preemption)."""
        self._finished_ids.clear()
        self._pending_forks.clear()
