"""One `schedule()` step: which tokens of which groups run, preemption, swap-in and admission (see
scheduler.py for the policy). The plan entries are the plan builder's (plan_builder.py)."""

from __future__ import annotations

from itertools import repeat

from scheduler_svc.kv.kv_manager import AllocStatus, BlockPair, KVCacheManager
from scheduler_svc.request.sequence import Sequence, SequenceGroup, SequenceStatus
from scheduler_svc.sched.config import SchedulerConfig
from scheduler_svc.sched.plan_builder import PlanBuilder
from scheduler_svc.sched.request_table import RequestTable, arrival_order
from scheduler_svc.wire.errors import OUTGREW_KV_CACHE

# A backlog of prompt tokens lifts max_prefill_tokens_while_decoding to 1/this of it a step (at t = 0 of
# an offline batch the cap then costs a few steps' worth of prefill pace instead of 6 % of the run's
# tokens/s: docs/benchmarks.md "Round 7").
PREFILL_BACKLOG_STEPS = 4


def _is_running(group: SequenceGroup) -> bool:
    return bool(group.seqs) and group.seqs[0].status is SequenceStatus.RUNNING


class SchedulingPass:
    """Lives for one `schedule()`: the budget left, what it scheduled and whom it preempted."""

    def __init__(
        self, config: SchedulerConfig, kv: KVCacheManager, plans: PlanBuilder, requests: RequestTable,
        oldest_in_flight: int | None = None,
    ):
        self.config = config
        self.kv = kv
        self.plans = plans
        self.requests = requests
        self.budget = config.max_num_batched_tokens
        # max_prefill_tokens_while_decoding: prompt tokens count against it once the step decodes
        self.prefill_cap = config.max_prefill_tokens_while_decoding if config.enable_chunked_prefill else 0
        self._lifted_cap: int | None = None  # the cap with the backlog's lift, computed when first needed
        self.num_decodes = 0
        self.num_prompt_tokens = 0
        self.num_seqs = 0
        self.scheduled: list[Sequence] = []
        self.scheduled_groups: set[int] = set()
        self.preempted = False
        self.num_preemptions = 0
        self.previous_step = plans.plan.step_id - 1  # the step whose samples a decode may take unseen
        # the oldest step whose result is not in (this plan's own id when none is in flight)
        self.oldest_in_flight = plans.plan.step_id if oldest_in_flight is None else oldest_in_flight

    def run(self) -> list[Sequence]:
        single_decodes: list[SequenceGroup] = []
        multi: list[SequenceGroup] = []
        prefilling: list[SequenceGroup] = []
        previous = self.previous_step
        for group in self.requests.running:
            seqs = group.seqs
            if len(seqs) == 1 and (group.samples_forked or group.sampling_params.n == 1):
                seq = seqs[0]
                if len(seq.token_ids) - seq.num_computed_tokens == 1:
                    if not seq.pending or seq.pending_step == previous:
                        single_decodes.append(group)
                    continue  # (else its input is a token an older step in flight samples: _held)
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
        max_num_seqs, requests = self.config.max_num_seqs, self.requests
        while groups:
            batch = groups[: max(0, min(self.budget, max_num_seqs - self.num_seqs))]
            if not batch:
                return
            num_served, copies = self.kv.append_decode_slots(batch)
            if num_served:
                served = batch[:num_served]
                seqs = [group.seqs[0] for group in served]
                self.plans.add(seqs, repeat(1), served, copies)
                self.scheduled.extend(seqs)
                self.scheduled_groups.update(map(id, served))
                self.budget -= num_served
                self.num_decodes += num_served
                self.num_seqs += num_served
            if num_served == len(batch):
                groups = groups[num_served:]
                continue
            group = batch[num_served]  # needs a block and none is free
            victim = self._pick_victim(group)
            if victim is None and requests.running == [group]:
                requests.drop_unservable(group, OUTGREW_KV_CACHE)
            else:
                self._preempt(victim or group)
            groups = [g for g in groups[num_served:] if _is_running(g)]

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
            self.requests.fork_seq(group, seq0)

    def _prompt_budget(self) -> int:
        """Tokens a prompt may still take this step: the step's budget, and once the step decodes,
        what is left of the prompt cap (decodes are scheduled first; `_cap_while_decoding`)."""
        if self.prefill_cap and self.num_decodes:
            return min(self.budget, self._cap_while_decoding() - self.num_prompt_tokens)
        return self.budget

    def _cap_while_decoding(self) -> int:
        """max_prefill_tokens_while_decoding, lifted by a backlog: at least 1/PREFILL_BACKLOG_STEPS of the
        tokens the waiting requests have to compute, so a queue of prompts (a burst, an offline batch)
        drains in a few steps as without a cap, while a lone long prompt (running once its first chunk
        is in) joins the running streams in chunks of the cap."""
        if self._lifted_cap is None:
            # past PREFILL_BACKLOG_STEPS x the step's budget the lift no longer matters: stop counting
            # there, so a flood of waiting requests costs a bounded walk per step
            enough = PREFILL_BACKLOG_STEPS * self.config.max_num_batched_tokens
            backlog = 0
            for group in self.requests.waiting:
                seq = group.seqs[0]
                backlog += seq.num_tokens - seq.num_computed_tokens
                if backlog >= enough:
                    break
            self._lifted_cap = max(self.prefill_cap, -(-backlog // PREFILL_BACKLOG_STEPS))
        return self._lifted_cap

    def _held(self, group: SequenceGroup) -> bool:
        """Whether a sequence of the group has a token still being sampled by a step older than the
        previous one (plans built two ahead, scheduler.py): a plan's only unknown input is the token
        the step just before it samples, so the group sits this step out (its result is one step
        away). Never with one plan ahead."""
        previous = self.previous_step
        return any(seq.pending and seq.pending_step != previous for seq in group.seqs)

    def _in_flight(self, group: SequenceGroup) -> bool:
        """Whether a preempted group (waiting or swapped) still has tokens in a step whose result is
        not in: a placeholder, or a sample with none (its last token). It comes back once they are
        known, never from a plan built before them (a prefill would carry a placeholder, or a result
        would reach a sequence that started over). Never with one plan ahead: a group preempted by
        plan k could come back in plan k + 1 at the soonest, built after step k - 1's result."""
        oldest = self.oldest_in_flight  # (a placeholder stands for a step in flight that scheduled it)
        return any(seq.scheduled_step >= oldest for seq in group.seqs)

    def _tokens_to_compute(self, group: SequenceGroup) -> list[tuple[Sequence, int]]:
        """(seq, num_new_tokens) to schedule now, [] when the group cannot run this step."""
        if self._held(group):
            return []
        self._maybe_fork_samples(group)
        unforked = group.sampling_params.n > 1 and not group.samples_forked
        todo: list[tuple[Sequence, int]] = []
        total = 0
        for seq in group.seqs:
            target = seq.prompt_len - 1 if unforked else seq.num_tokens
            num_new = target - seq.num_computed_tokens
            if num_new > 0:
                leader = seq.waits_for
                if leader is not None:
                    # its head is in the leader's blocks: it starts once an earlier plan computed
                    # them (a step runs after every step planned before it; `_commit` advances
                    # the leader only after this loop, so never in the leader's own step)
                    if leader.num_computed_tokens < seq.num_computed_tokens:
                        continue
                    seq.waits_for = None
                todo.append((seq, num_new))
                total += num_new
        if not todo or self.num_seqs + len(todo) > self.config.max_num_seqs:
            return []
        budget = self._prompt_budget() if total > len(todo) else self.budget  # prompt tokens, or decodes
        if total <= budget:
            return todo
        # Over budget: take sequences in order; the one that does not fit is chunked when chunked
        # prefill is on, else it (and those after it) wait for a later step.
        chunked_prefill = self.config.enable_chunked_prefill
        partial = []
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
            if victim is None and self.requests.running == [group]:
                # Alone in the cache and still short of blocks: it can never make progress.
                self.requests.drop_unservable(group, OUTGREW_KV_CACHE)
                return
            self._preempt(victim or group)
            if victim is None:
                return
        self._commit(group, todo)

    def _pick_victim(self, group: SequenceGroup) -> SequenceGroup | None:
        for candidate in reversed(self.requests.running):
            if candidate is not group and id(candidate) not in self.scheduled_groups:
                return candidate
        return None

    def _preempt(self, group: SequenceGroup) -> None:
        requests, kv, config = self.requests, self.kv, self.config
        self.preempted = True
        self.num_preemptions += 1
        group.num_preemptions += 1
        requests.running.remove(group)
        swap = config.preemption_mode == "swap" or len(group.seqs) > 1
        if swap and config.num_cpu_blocks and kv.can_swap_out(group):
            self.plans.swap_out(group, kv.swap_out(group))
            for seq in group.seqs:
                seq.status = SequenceStatus.SWAPPED
            requests.insert_swapped(group)
            return
        requests.preempt_by_recompute(group)
        requests.waiting.appendleft(group)

    # ---- swapped and waiting -----------------------------------------------------------------------
    def _resume_swapped(self) -> None:
        requests = self.requests
        while requests.swapped:
            group = requests.swapped[0]
            if self._in_flight(group):
                return
            todo = self._tokens_to_compute(group)
            if not todo:
                return
            if not self.kv.can_swap_in(group):
                if not requests.running and not self.scheduled:
                    requests.swapped.pop(0)
                    requests.drop_unservable(group, OUTGREW_KV_CACHE)
                    continue
                return
            self.plans.swap_in(self.kv.swap_in(group))
            requests.swapped.pop(0)
            group.set_status(SequenceStatus.RUNNING)
            requests.insert_running(group)
            need = {seq.seq_id: num_new for seq, num_new in todo}
            if self.kv.can_append_slots(group, need):
                self._commit(group, todo)

    def _admit_waiting(self) -> None:
        requests, config = self.requests, self.config
        while requests.waiting and self._prompt_budget() > 0:
            group = requests.waiting[0]
            if requests.swapped and arrival_order(requests.swapped[0]) < arrival_order(group):
                return  # FCFS: an earlier swapped group comes back first
            if self._in_flight(group):
                return
            params = group.sampling_params  # room for every sample or beam the group will grow to
            num_waiting = max(len(group.seqs) + (params.n - 1 if not group.samples_forked else 0),
                              params.beam_width)
            if self.num_seqs + num_waiting > config.max_num_seqs:
                return
            if not config.enable_chunked_prefill:
                upper = max(seq.num_tokens - seq.num_computed_tokens for seq in group.seqs)
                if upper > self.budget:  # (before prefix-cache hits) its first sequence must fit whole
                    return
            status = self.kv.can_allocate(group)
            alone = not requests.running and not requests.swapped and not self.scheduled
            if status is AllocStatus.LATER and alone:
                status = AllocStatus.NEVER  # it does not fit even with nothing else in the cache
            if status is AllocStatus.NEVER:
                requests.waiting.popleft()
                requests.drop_unservable(group, "the request no longer fits in the KV cache")
                continue
            if status is AllocStatus.LATER:
                return
            requests.waiting.popleft()
            self.kv.allocate(group)
            group.set_status(SequenceStatus.RUNNING)
            if group.first_scheduled_time is None:
                group.first_scheduled_time = requests.clock()
            requests.insert_running(group)
            todo = self._tokens_to_compute(group)
            # n > 1 forks need copy-on-write blocks: if there are none now, the group waits in
            # running for the next step (where it may preempt later arrivals).
            if todo and self.kv.can_append_slots(group, {seq.seq_id: num_new for seq, num_new in todo}):
                self._commit(group, todo)

    # ---- plan entries --------------------------------------------------------------------------------
    def _commit(self, group: SequenceGroup, todo: list[tuple[Sequence, int]]) -> None:
        append_slots = self.kv.append_slots
        copies: dict[int, list[BlockPair]] = {}
        for i, (seq, num_new) in enumerate(todo):
            pairs = append_slots(seq, num_new)
            if pairs:
                copies[i] = pairs
        seqs = [seq for seq, _ in todo]
        self.plans.add(seqs, [num_new for _, num_new in todo], repeat(group), copies)
        self.scheduled.extend(seqs)
        total = sum(num_new for _, num_new in todo)
        self.budget -= total
        if total > len(todo):
            self.num_prompt_tokens += total
        else:
            self.num_decodes += total
        self.num_seqs += len(todo)
        self.scheduled_groups.add(id(group))
