"""The seams of one executor rank: what its gRPC servicer and its metrics ask of a worker.

`executor_svc.worker.worker.Worker` implements both protocols; benches and tests serve fakes that
implement `StepWorker` (`OneStepAtATime` gives them launch / wait / finish). No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, TypeVar

from scheduler_svc.wire.step_plan import StepPlan, StepResult
from scheduler_svc.wire.worker_description import WorkerDescription

StepT = TypeVar("StepT")


class StepWorker(Protocol[StepT]):
    """What the Executor servicer calls, one call at a time, each in a worker thread.

    Steps: `execute(plan)` runs one plan to the end. `launch(plan)` applies a plan and queues its
    work, returning a handle (`StepT`); `wait(handle)` blocks until that step's work is done (not
    the work of steps launched after it); `finish(handle)` returns its result. Steps are finished
    in the order they were launched. When `launches_ahead` is True the servicer launches the next
    plan before it finishes the current step (the device goes on while the host collects); when
    False it calls `execute` one plan at a time.

    Errors: StepOrderError (executor_svc.runner.errors) when a plan does not follow the last step,
    PlanError when it names state the worker does not hold; the scheduler then calls `reset`.
    """

    @property
    def launches_ahead(self) -> bool: ...

    def describe(self) -> WorkerDescription:
        """The model, the rank and the KV blocks that fit (or the counts set by `init_cache`)."""
        ...

    def init_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        """Allocates the caches with the counts the scheduler settled on; drops all sequence state.
        ValueError when more blocks are asked for than fit."""
        ...

    def reset(self) -> None:
        """Drops every sequence's state and the step count: the next plan may carry any step_id."""
        ...

    def execute(self, plan: StepPlan) -> StepResult: ...

    def launch(self, plan: StepPlan) -> StepT: ...

    def wait(self, step: StepT) -> None: ...

    def finish(self, step: StepT) -> StepResult: ...


class OneStepAtATime:
    """launch / wait / finish for a worker whose `execute` runs a plan to the end (fakes, sims):
    `launch` executes, `finish` hands the result back."""

    launches_ahead = False

    def execute(self, plan: StepPlan) -> StepResult:
        raise NotImplementedError

    def launch(self, plan: StepPlan) -> StepResult:
        return self.execute(plan)

    def wait(self, step: StepResult) -> None:
        pass

    def finish(self, step: StepResult) -> StepResult:
        return step


@dataclass(frozen=True, slots=True)
class MemoryUsage:
    """One rank's memory at one moment (read at scrape time by executor_svc/server/metrics.py)."""

    gpu_allocated_bytes: int  # held by tensors (torch's caching allocator); 0 on a CPU executor
    gpu_reserved_bytes: int  # reserved by torch's caching allocator; 0 on a CPU executor
    kv_cache_gpu_bytes: int  # the device KV cache, 0 until it is allocated
    kv_cache_cpu_bytes: int  # the CPU swap space, 0 until it is allocated


class ReportsMemory(Protocol):
    """What executor metrics ask of a worker."""

    def memory_usage(self) -> MemoryUsage: ...
