"""The scheduler's requests: the three queues, every live sequence by id, and the sequence
operations (finish, fork, drop, recompute preemption) that keep the KV manager and the executor
mirror (plan_builder.py) in step with them."""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable

from scheduler_svc.kv.kv_manager import KVCacheManager
from scheduler_svc.request.sequence import FinishReason, Sequence, SequenceGroup, SequenceStatus
from scheduler_svc.sched.output_processor import RequestOutput
from scheduler_svc.sched.plan_builder import PlanBuilder


def arrival_order(group: SequenceGroup) -> tuple[float, int]:
    return (group.arrival_time, group.arrival_index)


class RequestTable:
    """Queues in arrival order: `waiting` (a deque: preempted groups go back to its front),
    `running`, `swapped`. `seqs` maps each live seq id to (sequence, group)."""

    def __init__(self, kv: KVCacheManager, plans: PlanBuilder, clock: Callable[[], float]):
        self.kv = kv
        self.plans = plans
        self.clock = clock
        self.waiting: deque[SequenceGroup] = deque()
        self.running: list[SequenceGroup] = []
        self.swapped: list[SequenceGroup] = []
        self.groups: dict[str, SequenceGroup] = {}
        self.seqs: dict[int, tuple[Sequence, SequenceGroup]] = {}
        self.dropped: list[RequestOutput] = []  # outputs of requests dropped outside process_result
        self._next_seq_id = 0

    def new_seq_id(self) -> int:
        self._next_seq_id += 1
        return self._next_seq_id

    def insert_running(self, group: SequenceGroup) -> None:
        bisect.insort(self.running, group, key=arrival_order)

    def insert_swapped(self, group: SequenceGroup) -> None:
        bisect.insort(self.swapped, group, key=arrival_order)

    # ---- sequence operations (the output processor's SeqOps) ----------------------------------------
    def finish_seq(self, group: SequenceGroup, seq: Sequence, reason: FinishReason) -> None:
        seq.drop_placeholders()  # (planned two ahead: the step after its last one sampled for nothing)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        group.seqs.remove(seq)
        group.finished_seqs.append(seq)
        self.kv.free(seq)
        self.plans.forget(seq)
        del self.seqs[seq.seq_id]

    def fork_seq(self, group: SequenceGroup, parent: Sequence) -> Sequence:
        assert not parent.pending, "a sequence waiting for its sampled token is never forked"
        child = Sequence(
            self.new_seq_id(),
            list(parent.token_ids),
            parent.prompt_len,
            sample_index=len(group.seqs) + len(group.finished_seqs),
            status=parent.status,
            num_computed_tokens=parent.num_computed_tokens,
            cumulative_logprob=parent.cumulative_logprob,
            output_logprobs=list(parent.output_logprobs),
        )
        self.kv.fork(parent, child)
        self.plans.fork(child, parent)
        group.seqs.append(child)
        self.seqs[child.seq_id] = (child, group)
        return child

    # ---- whole groups ----------------------------------------------------------------------------
    def finish_group(self, group: SequenceGroup) -> None:
        self.groups.pop(group.request_id, None)
        group.finished_time = self.clock()
        for queue in (self.running, self.swapped, self.waiting):
            if group in queue:
                queue.remove(group)
                break

    def abort(self, request_id: str) -> bool:
        """Drop a request now: its blocks are freed, its seq ids go out with the next plan."""
        group = self.groups.get(request_id)
        if group is None:
            return False
        for seq in list(group.seqs):
            self.finish_seq(group, seq, FinishReason.ABORT)
        self.finish_group(group)
        return True

    def drop_unservable(self, group: SequenceGroup, error: str) -> None:
        """A request that can never make progress ends with `error`."""
        self.abort(group.request_id)
        self.dropped.append(RequestOutput(group.request_id, finished=True, error=error))

    def preempt_by_recompute(self, group: SequenceGroup) -> None:
        """Free the group's blocks (GPU or CPU) and forget its executor state; prompt + outputs
        become the prompt to prefill again. The caller requeues it in `waiting`."""
        for seq in group.seqs:
            self.kv.free(seq)
            seq.num_computed_tokens = 0
            seq.waits_for = None
            seq.status = SequenceStatus.WAITING
            self.plans.forget(seq)
        if group.beam is not None:
            group.beam.pending.clear()
