"""One `schedule()` step: which tokens of which groups run, preemption, swap-in, admission, and
the diff-based plan entries of every scheduled sequence (see scheduler.py for the policy)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from scheduler_svc.kv.kv_manager import AllocStatus
from scheduler_svc.request.sequence import Sequence, SequenceGroup, SequenceStatus
from scheduler_svc.wire.step_plan import ContinuingSequence, NewSequence, StepPlan

if TYPE_CHECKING:
    from scheduler_svc.sched.scheduler import Scheduler


def arrival_order(group: SequenceGroup) -> tuple[float, int]:
    return (group.arrival_time, group.arrival_index)


def preempt_by_recompute(sched: Scheduler, group: SequenceGroup) -> None:
    """Recompute preemption: free the group's blocks (GPU or CPU) and forget its executor state;
    prompt + outputs become the prompt to prefill again. The caller requeues it in `waiting`."""
    for seq in group.seqs:
        sched.kv.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        sched._forget_executor_state(seq)
    if group.beam is not None:
        group.beam.pending.clear()


def _is_running(group: SequenceGroup) -> bool:
    return bool(group.seqs) and group.seqs[0].status is SequenceStatus.RUNNING


class SchedulingPass:
    def __init__(self, sched: Scheduler, plan: StepPlan):
        self.sched = sched
        self.kv = sched.kv
        self.plan = plan
        self.budget = sched.config.max_num_batched_tokens
        self.num_seqs = 0
        self.scheduled: list[Sequence] = []
        self.scheduled_groups: set[int] = set()
        self.preempted = False

    def run(self) -> list[Sequence]:
        single_decodes, multi, prefilling = [], [], []
        for group in self.sched.running:
            seqs = group.seqs
            if len(seqs) == 1 and (group.samples_forked or group.sampling_params.n == 1):
                seq = seqs[0]
                if len(seq.token_ids) - seq.num_computed_tokens == 1:
                    single_decodes.append(group)
                    continue
            (prefilling if self._is_prefilling(group) else multi).append(group)
        self._schedule_single_decodes(single_decodes)
        for group in multi + prefilling:
            if _is_running(group):  # not preempted or dropped earlier in this pass
                self._schedule_running(group)
        if not self.preempted:
            self._resume_swapped()
        if not self.preempted:
            self._admit_waiting()
        return self.scheduled

    def _schedule_single_decodes(self, groups: list[SequenceGroup]) -> None:
        """The common case in a tight loop: one-sequence groups decoding one token each."""
        max_num_seqs = self.sched.config.max_num_seqs
        while groups:
            batch = groups[: max(0, min(self.budget, max_num_seqs - self.num_seqs))]
            if not batch:
                return
            num_served, copies = self.kv.append_decode_slots(batch)
            self._commit_decodes(batch[:num_served], copies)
            if num_served == len(batch):
                groups = groups[num_served:]
                continue
            group = batch[num_served]  # needs a block and none is free
            victim = self._pick_victim(group)
            if victim is None and self.sched.running == [group]:
                self.sched._drop_unservable(group, "the request outgrew the KV cache")
            else:
                self._preempt(victim or group)
            groups = [g for g in groups[num_served:] if _is_running(g)]

    def _commit_decodes(self, groups: list[SequenceGroup], copies: dict[int, list]) -> None:
        plan, block_table = self.plan, self.kv.block_table
        cont_append, scheduled_append = plan.cont_seqs.append, self.scheduled.append
        decode_ids_append, decode_tokens_append = plan.decode_seq_ids.append, plan.decode_token_ids.append
        scheduled_groups = self.scheduled_groups
        block_size = self.kv.block_size
        for i, group in enumerate(groups):
            seq = group.seqs[0]
            if copies and i in copies:
                plan.copies.extend(copies[i])
                seq.executor_num_blocks = min(seq.executor_num_blocks, seq.num_computed_tokens // block_size)
            table = block_table(seq)
            token_ids = seq.token_ids
            if seq.executor_num_tokens < 0:
                self._append_new(seq, 1, table, group)
            elif seq.executor_num_tokens == len(token_ids) - 1 and seq.executor_num_blocks == len(table):
                decode_ids_append(seq.seq_id)
                decode_tokens_append(token_ids[-1])
            else:
                start = seq.executor_num_blocks
                cont_append(
                    ContinuingSequence(
                        seq.seq_id, 1, token_ids[seq.executor_num_tokens :], start, table[start:]
                    )
                )
            seq.executor_num_tokens = len(token_ids)
            seq.executor_num_blocks = len(table)
            seq.num_computed_tokens += 1
            scheduled_append(seq)
            scheduled_groups.add(id(group))
        self.budget -= len(groups)
        self.num_seqs += len(groups)

    # ---- what to compute -------------------------------------------------------------------------
    @staticmethod
    def _is_prefilling(group: SequenceGroup) -> bool:
        if group.sampling_params.n > 1 and not group.samples_forked:
            return True
        return any(seq.num_tokens - seq.num_computed_tokens > 1 for seq in group.seqs)

    def _maybe_fork_samples(self, group: SequenceGroup) -> None:
        """n > 1: once the prompt but its last token is computed, fork the n-1 other samples."""
        n = group.sampling_params.n
        if n == 1 or group.samples_forked:
            return
        seq0 = group.seqs[0]
        if seq0.num_computed_tokens < seq0.prompt_len - 1:
            return
        group.samples_forked = True
        for _ in range(n - 1):
            self.sched.fork_seq(group, seq0)

    def _tokens_to_compute(self, group: SequenceGroup) -> list[tuple[Sequence, int]]:
        """(seq, num_new_tokens) to schedule now, [] when the group cannot run this step."""
        self._maybe_fork_samples(group)
        unforked = group.sampling_params.n > 1 and not group.samples_forked
        todo = []
        total = 0
        for seq in group.seqs:
            target = seq.prompt_len - 1 if unforked else seq.num_tokens
            num_new = target - seq.num_computed_tokens
            if num_new > 0:
                todo.append((seq, num_new))
                total += num_new
        if not todo or self.num_seqs + len(todo) > self.sched.config.max_num_seqs:
            return []
        if total <= self.budget:
            return todo
        # Over budget: take sequences in order; the one that does not fit is chunked when chunked
        # prefill is on, else it (and those after it) wait for a later step.
        chunked_prefill = self.sched.config.enable_chunked_prefill
        partial = []
        budget = self.budget
        for seq, num_new in todo:
            if num_new <= budget:
                partial.append((seq, num_new))
                budget -= num_new
            else:
                if chunked_prefill and budget > 0:
                    partial.append((seq, budget))
                break
        return partial

    # ---- running ---------------------------------------------------------------------------------
    def _schedule_running(self, group: SequenceGroup) -> None:
        todo = self._tokens_to_compute(group)
        if not todo:
            return
        need = {seq.seq_id: num_new for seq, num_new in todo}
        while not self.kv.can_append_slots(group, need):
            victim = self._pick_victim(group)
            if victim is None and self.sched.running == [group]:
                # Alone in the cache and still short of blocks: it can never make progress.
                self.sched._drop_unservable(group, "the request outgrew the KV cache")
                return
            self._preempt(victim or group)
            if victim is None:
                return
        self._commit(group, todo)

    def _pick_victim(self, group: SequenceGroup) -> SequenceGroup | None:
        for candidate in reversed(self.sched.running):
            if candidate is not group and id(candidate) not in self.scheduled_groups:
                return candidate
        return None

    def _preempt(self, group: SequenceGroup) -> None:
        sched, kv = self.sched, self.kv
        self.preempted = True
        sched.num_preemptions += 1
        sched.running.remove(group)
        mode = sched.config.preemption_mode
        if (mode == "swap" or len(group.seqs) > 1) and sched.config.num_cpu_blocks and kv.can_swap_out(group):
            self.plan.swap_out.extend(kv.swap_out(group))
            for seq in group.seqs:
                seq.status = SequenceStatus.SWAPPED
                seq.executor_num_blocks = 0  # swap-in resends the whole table
            sched._insert_swapped(group)
            return
        preempt_by_recompute(sched, group)
        sched.waiting.appendleft(group)

    # ---- swapped and waiting -----------------------------------------------------------------------
    def _resume_swapped(self) -> None:
        sched = self.sched
        while sched.swapped:
            group = sched.swapped[0]
            todo = self._tokens_to_compute(group)
            if not todo:
                return
            if not self.kv.can_swap_in(group):
                if not sched.running and not self.scheduled:
                    sched.swapped.pop(0)
                    sched._drop_unservable(group, "the request outgrew the KV cache")
                    continue
                return
            self.plan.swap_in.extend(self.kv.swap_in(group))
            sched.swapped.pop(0)
            group.set_status(SequenceStatus.RUNNING)
            sched._insert_running(group)
            need = {seq.seq_id: num_new for seq, num_new in todo}
            if self.kv.can_append_slots(group, need):
                self._commit(group, todo)

    def _admit_waiting(self) -> None:
        sched = self.sched
        while sched.waiting and self.budget > 0:
            group = sched.waiting[0]
            if sched.swapped and arrival_order(sched.swapped[0]) < arrival_order(group):
                return  # FCFS: an earlier swapped group comes back first
            params = group.sampling_params  # room for every sample or beam the group will grow to
            num_waiting = max(len(group.seqs) + (params.n - 1 if not group.samples_forked else 0),
                              params.beam_width)
            if self.num_seqs + num_waiting > sched.config.max_num_seqs:
                return
            if not sched.config.enable_chunked_prefill:
                upper = max(seq.num_tokens - seq.num_computed_tokens for seq in group.seqs)
                if upper > self.budget:  # (before prefix-cache hits) its first sequence must fit whole
                    return
            status = self.kv.can_allocate(group)
            if status is AllocStatus.LATER and not sched.running and not sched.swapped and not self.scheduled:
                status = AllocStatus.NEVER  # it does not fit even with nothing else in the cache
            if status is AllocStatus.NEVER:
                sched.waiting.popleft()
                sched._drop_unservable(group, "the request no longer fits in the KV cache")
                continue
            if status is AllocStatus.LATER:
                return
            sched.waiting.popleft()
            self.kv.allocate(group)
            group.set_status(SequenceStatus.RUNNING)
            if group.first_scheduled_time is None:
                group.first_scheduled_time = sched.clock()
            sched._insert_running(group)
            todo = self._tokens_to_compute(group)
            # n > 1 forks need copy-on-write blocks: if there are none now, the group waits in
            # running for the next step (where it may preempt later arrivals).
            if todo and self.kv.can_append_slots(group, {seq.seq_id: num_new for seq, num_new in todo}):
                self._commit(group, todo)

    # ---- plan entries --------------------------------------------------------------------------------
    def _commit(self, group: SequenceGroup, todo: list[tuple[Sequence, int]]) -> None:
        kv, plan = self.kv, self.plan
        block_size = kv.block_size
        for seq, num_new in todo:
            copies = kv.append_slots(seq, num_new)
            if copies:
                plan.copies.extend(copies)
                seq.executor_num_blocks = min(seq.executor_num_blocks, seq.num_computed_tokens // block_size)
            table = kv.block_table(seq)
            token_ids = seq.token_ids
            if seq.executor_num_tokens < 0:
                self._append_new(seq, num_new, table, group)
            elif (num_new == 1 and seq.executor_num_tokens == len(token_ids) - 1 == seq.num_computed_tokens
                  and seq.executor_num_blocks == len(table)):
                plan.decode_seq_ids.append(seq.seq_id)
                plan.decode_token_ids.append(token_ids[-1])
            else:
                start = seq.executor_num_blocks
                plan.cont_seqs.append(
                    ContinuingSequence(
                        seq.seq_id, num_new, token_ids[seq.executor_num_tokens :], start, table[start:]
                    )
                )
            seq.executor_num_tokens = len(token_ids)
            seq.executor_num_blocks = len(table)
            seq.num_computed_tokens += num_new
            self.scheduled.append(seq)
            self.budget -= num_new
        self.num_seqs += len(todo)
        self.scheduled_groups.add(id(group))

    def _append_new(self, seq: Sequence, num_new: int, table: list[int], group: SequenceGroup) -> None:
        self.plan.new_seqs.append(
            NewSequence(
                seq.seq_id,
                list(seq.token_ids),
                seq.num_computed_tokens,
                num_new,
                list(table),
                group.sampling_params,
                seq.sample_index,
                seq.prompt_len,
            )
        )
