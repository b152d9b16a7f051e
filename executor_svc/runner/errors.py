"""Errors the executor raises for a bad plan. They are the API's errors (scheduler_svc/wire/errors.py):
each names its gRPC status code, which the one mapping (`maps_errors`) gives the caller."""

from scheduler_svc.wire.errors import ApiError


class PlanError(ApiError, ValueError):
    """A step plan is inconsistent with the executor's state (unknown sequence, short block table,
    block id out of range...). The worker's state may be partly updated: reset it."""

    code = "INVALID_ARGUMENT"


class StepOrderError(ApiError, RuntimeError):
    """A plan's step_id does not follow the step this worker last ran (reset the worker to recover)."""

    code = "FAILED_PRECONDITION"


class CacheAllocationError(ApiError, MemoryError):
    """The KV cache of the requested size does not fit in the device's free memory. Not transient:
    the scheduler stops (and says so) instead of asking again."""

    code = "RESOURCE_EXHAUSTED"
