"""What the engine may ask of a scheduler (`SchedulerInterface`) and the figures it reports
(`SchedulerStats`): the engine reads no scheduler or KV manager internals."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from scheduler_svc.request.sequence import FinishReason, SequenceGroup
from scheduler_svc.sched.config import SchedulerConfig
from scheduler_svc.sched.output_processor import RequestOutput
from scheduler_svc.wire.sampling_params import SamplingParams
from scheduler_svc.wire.step_plan import StepPlan, StepResult


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    """A snapshot of the scheduler's queues and its KV manager's figures."""

    num_waiting: int
    num_running: int  # requests
    num_swapped: int
    num_running_seqs: int  # live sequences of the running requests
    num_preemptions: int
    preemption_mode: str
    kv_policy: str
    num_total_gpu_blocks: int
    num_free_gpu_blocks: int
    num_free_cpu_blocks: int
    num_cached_free_blocks: int  # free GPU blocks that still hold a findable prefix
    num_shared_block_refs: int  # blocks saved by sharing
    num_prefix_query_tokens: int  # totals since start
    num_prefix_hit_tokens: int


class SchedulerInterface(Protocol):
    """The scheduler as the engine loop drives it (one thread; see scheduler.py for the policy).

    Per step: `schedule()` → the plan goes to the executors → `process_result(result)` with the
    step's result, in plan order. While one plan is in flight, `schedule()` may build the next one
    only when `can_schedule_ahead()`.
    """

    clock: Callable[[], float]  # the time of its groups' timestamps (arrival, first scheduled, ...)

    @property
    def config(self) -> SchedulerConfig:
        """Its sizes and policies (the server reports some of them)."""
        ...

    def new_group(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        arrival_time: float | None = None,
        expected_output_len: int | None = None,
    ) -> SequenceGroup:
        """A one-sequence request, not yet queued."""
        ...

    def add_request(self, group: SequenceGroup) -> None:
        """Queue a request that passed RequestValidator.check_schedulable (sched/validation.py)."""
        ...

    def abort(self, request_id: str) -> bool:
        """Drop a request now (its blocks are freed); False when it is unknown."""
        ...

    def finish_sequence(self, seq_id: int, reason: FinishReason = FinishReason.STOP) -> bool:
        """Finish one sequence as if it hit a stop token (stop strings)."""
        ...

    def get_group(self, request_id: str) -> SequenceGroup | None:
        """The unfinished request of that id, if any."""
        ...

    def dropped_error(self, request_id: str) -> str | None:
        """Why the request was dropped (it outgrew the KV cache, ...), when a plan built since the
        last `process_result` dropped it; its output with that error comes with the next result."""
        ...

    def has_unfinished(self) -> bool:
        """Whether some request is queued or running."""
        ...

    def can_schedule_ahead(self) -> bool:
        """Whether `schedule()` may build the next plan before the result of the one in flight."""
        ...

    def schedule(self) -> StepPlan:
        """The next step's plan (an empty plan when nothing can run)."""
        ...

    def process_result(self, result: StepResult) -> list[RequestOutput]:
        """Apply the result of the oldest plan in flight; the requests' outputs of that step."""
        ...

    def reset_for_recovery(self) -> None:
        """The executors lost their state: forget the plans in flight and recompute every request."""
        ...

    def stats(self) -> SchedulerStats:
        """The queues' and the KV manager's figures now."""
        ...
