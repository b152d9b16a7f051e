"""FCFS scheduler over waiting / running / swapped groups (vLLM paper §4.5), producing one
diff-based StepPlan per step and consuming the StepResult.

Each `schedule()`: (1) running groups in arrival order: one-sequence decodes first (a tight fast
path), then multi-sequence decodes, then groups still prefilling; when a group needs a block and
none is free, the latest-arrived running group not yet scheduled in this step is preempted (or
the group itself if there is none); (2) if nothing was preempted, swapped groups resume in
arrival order; (3) if nothing was preempted, waiting groups are admitted in arrival order (strict
FCFS: the first one that does not fit stops admission, and none passes an earlier swapped
group), all within `max_num_batched_tokens` and `max_num_seqs`. With chunked prefill a prompt
takes whatever budget is left and continues in later steps; without it, a group's sequences each
run whole (a group may spread over steps).

A request that can never make progress (alone in the cache and still short of blocks) is dropped
with `RequestOutput.error` set instead of looping forever.

Parallel sampling (n > 1): sequence 0 alone prefills the prompt except its last token; then n-1
children are forked (sharing every prompt block) and all n compute the last prompt token in one
step, each sampling its own first token (its own `sample_index` stream). The shared last block is
copied on write. Beam search: see beam_search.py and output_processor.py.

Async scheduling (`schedule()` while a plan is in flight, when `can_schedule_ahead()`): every
sequence that the step in flight will sample gets a placeholder token (PENDING_TOKEN, see
step_plan.py), so it is scheduled as a decode of that unknown token; `process_result` puts the real
token in its place. A sequence that then turns out to be finished (a stop token) has one wasted
token computed in the plan ahead; its result is ignored. A sequence sampling its last token (its
max_tokens) gets no placeholder, so it is not scheduled ahead. Beam search needs every step's
result to choose the next tokens: while a beam group runs, plans are built one at a time. At most
1 + `config.plans_ahead` plans are in flight. With k plans ahead a sequence may hold k
placeholders (`Sequence.pending`, filled oldest first); one that finishes with placeholders left
drops them (their tokens were computed for nothing), and a preempted group that a step in flight still
computes is not admitted or swapped in until that step's result is in (a plan never carries a
placeholder other than a decode's input, the token of the step just before).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable

from scheduler_svc.kv.block_manager import BlockManager
from scheduler_svc.kv.kv_manager import KVCacheManager
from scheduler_svc.request.beam import BeamState
from scheduler_svc.request.sequence import FinishReason, Sequence, SequenceGroup, SequenceStatus
from scheduler_svc.sched.config import SchedulerConfig
from scheduler_svc.sched.interface import SchedulerStats
from scheduler_svc.sched.output_processor import (
    RequestOutput,
    process_samples,
    process_single_sample,
    stop_token_ids_of,
)
from scheduler_svc.sched.plan_builder import PlanBuilder
from scheduler_svc.sched.request_table import RequestTable, arrival_order
from scheduler_svc.sched.scheduling_pass import SchedulingPass
from scheduler_svc.wire.sampling_params import SamplingParams
from scheduler_svc.wire.step_plan import PENDING_TOKEN, StepPlan, StepResult

_log = logging.getLogger(__name__)

__all__ = ["Scheduler", "SchedulerConfig"]


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv_manager: KVCacheManager | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.config = config
        self.kv = kv_manager or BlockManager(
            config.block_size,
            config.num_gpu_blocks,
            config.num_cpu_blocks,
            enable_prefix_caching=config.enable_prefix_caching,
            watermark_blocks=config.watermark_blocks,
        )
        self.clock = clock
        self.plans = PlanBuilder(self.kv)  # the executor mirror and the plan entries
        self.requests = RequestTable(self.kv, self.plans, clock)  # queues, sequences, their operations
        self._groups = self.requests.groups  # the table's own dicts
        self._seqs = self.requests.seqs
        self._next_arrival_index = 0
        self._step_id = 0
        # Sequences scheduled by each plan in flight (oldest first), and whether its successor was
        # built ahead (its sampled sequences hold placeholders).
        self._in_flight: deque[tuple[list[Sequence], bool]] = deque()
        self.num_preemptions = 0

    @property
    def waiting(self) -> deque[SequenceGroup]:
        return self.requests.waiting

    @property
    def running(self) -> list[SequenceGroup]:
        """Arrival order."""
        return self.requests.running

    @property
    def swapped(self) -> list[SequenceGroup]:
        """Arrival order."""
        return self.requests.swapped

    # ---- requests ------------------------------------------------------------------------------
    def new_group(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        arrival_time: float | None = None,
        expected_output_len: int | None = None,
    ) -> SequenceGroup:
        seq = Sequence(0, list(prompt_token_ids), len(prompt_token_ids))
        arrival = self.clock() if arrival_time is None else arrival_time
        return SequenceGroup(request_id, [seq], sampling_params, arrival, expected_output_len)

    def add_request(self, group: SequenceGroup) -> None:
        """Queue a one-sequence group (its seq id is assigned here). The group must have passed
        `RequestValidator.check_schedulable` (sched/validation.py: the engine checks every request
        there first); only the invariants that keep the scheduler sound are asserted here."""
        params, seq = group.sampling_params, group.seqs[0]
        assert group.request_id not in self._groups, f"request {group.request_id!r} is already in flight"
        assert len(group.seqs) == 1 and seq.num_tokens > 0, "one non-empty token sequence"
        assert seq.prompt_len + params.max_tokens <= self.config.max_model_len, "longer than max_model_len"
        assert max(params.n, params.beam_width) <= self.config.max_num_seqs, "wider than max_num_seqs"
        seq.seq_id = self._new_seq_id()
        seq.status = SequenceStatus.WAITING
        group.arrival_index = self._next_arrival_index
        self._next_arrival_index += 1
        group.stop_token_ids = stop_token_ids_of(group, self.config.eos_token_ids)
        if params.use_beam_search:
            group.beam = BeamState(params.beam_width, params.length_penalty)
        self._groups[group.request_id] = group
        self._seqs[seq.seq_id] = (seq, group)
        self.waiting.append(group)

    def abort(self, request_id: str) -> bool:
        """Drop a request now: its blocks are freed, its seq ids go out with the next plan."""
        return self.requests.abort(request_id)

    def finish_sequence(self, seq_id: int, reason: FinishReason = FinishReason.STOP) -> bool:
        """Hook for stop strings (detokenizer): finish one sequence as if it hit a stop token."""
        entry = self._seqs.get(seq_id)
        if entry is None:
            return False
        seq, group = entry
        self.requests.finish_seq(group, seq, reason)
        if group.is_finished:
            self.requests.finish_group(group)
        return True

    def has_unfinished(self) -> bool:
        return bool(self._groups)

    def get_group(self, request_id: str) -> SequenceGroup | None:
        return self._groups.get(request_id)

    def dropped_error(self, request_id: str) -> str | None:
        return next((out.error for out in self.requests.dropped if out.request_id == request_id), None)

    def reset_for_recovery(self) -> None:
        """The executors lost their KV and sequence state (a rank failed; they will be Reset):
        every group is preempted by recompute (all GPU and CPU blocks freed; prompt + generated
        tokens are prefilled again, so no output is lost) and waits at the front in arrival order.
        The step in flight is forgotten and the prefix cache emptied (it names lost KV)."""
        groups = sorted([*self.running, *self.swapped, *self.waiting], key=arrival_order)
        self.running.clear()
        self.swapped.clear()
        self.waiting.clear()
        for group in groups:
            for seq in group.seqs:
                seq.drop_placeholders()  # their tokens were lost with the steps in flight (never streamed)
            self.requests.preempt_by_recompute(group)
            self.waiting.append(group)
        self._in_flight.clear()
        self.plans.reset()  # the reset executors hold no state to drop
        self.kv.clear_prefix_cache()

    def stats(self) -> SchedulerStats:
        kv = self.kv
        return SchedulerStats(
            num_waiting=len(self.waiting),
            num_running=len(self.running),
            num_swapped=len(self.swapped),
            num_running_seqs=sum(len(g.seqs) for g in self.running),
            num_preemptions=self.num_preemptions,
            preemption_mode=self.config.preemption_mode,
            kv_policy=kv.policy_name,
            num_total_gpu_blocks=kv.num_total_blocks,
            num_free_gpu_blocks=kv.num_free_blocks,
            num_free_cpu_blocks=kv.num_free_cpu_blocks,
            num_cached_free_blocks=kv.num_cached_free_blocks,
            num_shared_block_refs=kv.num_shared_block_refs,
            num_prefix_query_tokens=kv.num_prefix_query_tokens,
            num_prefix_hit_tokens=kv.num_prefix_hit_tokens,
        )

    def _new_seq_id(self) -> int:
        return self.requests.new_seq_id()

    # ---- scheduling ------------------------------------------------------------------------------
    def can_schedule_ahead(self) -> bool:
        """Whether `schedule()` may build the next plan now, before the results of the plans in
        flight: one to `config.plans_ahead` are in flight, some request is unfinished, and no beam
        group runs (beam search picks each step's tokens from the previous step's candidates)."""
        return (
            0 < len(self._in_flight) <= self.config.plans_ahead
            and bool(self._groups)
            and not any(g.beam is not None for g in self.running)
        )

    def schedule(self) -> StepPlan:
        if self._in_flight:
            if not self.can_schedule_ahead():
                raise RuntimeError("schedule() called with a plan in flight that cannot be planned ahead of")
            last = self._in_flight[-1][0]
            self._add_placeholders(last)
            self._in_flight[-1] = (last, True)
        self._step_id += 1
        self.plans.begin(self._step_id)
        scheduling = SchedulingPass(self.config, self.kv, self.plans, self.requests,
                                    oldest_in_flight=self._step_id - len(self._in_flight))
        self._in_flight.append((scheduling.run(), False))
        self.num_preemptions += scheduling.num_preemptions
        return self.plans.end()

    def _add_placeholders(self, in_flight: list[Sequence]) -> None:
        """Each sequence the latest step in flight (self._step_id) samples gets PENDING_TOKEN as its
        next token, unless that sample is its last (max_tokens)."""
        running, seqs, step_id = SequenceStatus.RUNNING, self._seqs, self._step_id
        for seq in in_flight:
            num_tokens = len(seq.token_ids)
            if seq.status is not running or seq.num_computed_tokens != num_tokens:
                continue
            group = seqs[seq.seq_id][1]
            if num_tokens + 1 - seq.prompt_len >= group.sampling_params.max_tokens:
                continue
            seq.token_ids.append(PENDING_TOKEN)
            seq.pending += 1
            seq.pending_step = step_id

    def process_result(self, result: StepResult) -> list[RequestOutput]:
        oldest = self._step_id - len(self._in_flight) + 1
        if not self._in_flight or result.step_id != oldest:
            raise RuntimeError(f"result for step {result.step_id} does not answer the oldest plan in flight")
        in_flight, ahead = self._in_flight.popleft()
        seqs = self._seqs
        if ahead:  # the real tokens first: prefix-cache hashes below read them
            for sample in result.samples:
                entry = seqs.get(sample.seq_id)
                if entry is not None and entry[0].pending:
                    seq = entry[0]
                    seq.token_ids[len(seq.token_ids) - seq.pending] = sample.token_id
        running = SequenceStatus.RUNNING
        self.kv.mark_computed_many([s for s in in_flight if s.status is running])
        requests = self.requests
        outputs, requests.dropped = requests.dropped, []
        multi: dict[int, tuple[SequenceGroup, list]] = {}
        now = None
        for sample in result.samples:
            entry = seqs.get(sample.seq_id)
            if entry is None:
                continue  # aborted or finished meanwhile
            seq, group = entry
            # (A sequence preempted by the plan built ahead is WAITING or SWAPPED by now.)
            if seq.status is running and seq.num_computed_tokens < len(seq.token_ids) - seq.pending:
                raise RuntimeError(f"seq {seq.seq_id} got a token before its prefill completed")
            if group.first_token_time is None:
                group.first_token_time = now = now or self.clock()
            if group.beam is None and len(group.seqs) == 1:
                out = process_single_sample(requests, group, seq, sample)
                outputs.append(out)
                if out.finished:
                    requests.finish_group(group)
            elif id(group) in multi:
                multi[id(group)][1].append((seq, sample))
            else:
                multi[id(group)] = (group, [(seq, sample)])
        for group, samples in multi.values():
            try:
                group_out = process_samples(requests, group, samples, group.stop_token_ids)
            except Exception as err:  # noqa: BLE001 - this request's fault (e.g. beam scoring): it alone ends
                _log.exception("processing request %.64r failed; aborting it", group.request_id)
                requests.abort(group.request_id)
                error = f"internal error while processing this request: {type(err).__name__}: {err}"
                outputs.append(RequestOutput(group.request_id, finished=True, error=error))
                continue
            if group_out is not None:
                outputs.append(group_out)
            if group.is_finished:
                requests.finish_group(group)
        return outputs
