"""Errors the executor raises for a bad plan; the gRPC edge maps them to status codes."""


class PlanError(ValueError):
    """A step plan is inconsistent with the executor's state (unknown sequence, short block table,
    block id out of range...). The worker's state may be partly updated: reset it."""


class StepOrderError(RuntimeError):
    """A plan's step_id does not follow the step this worker last ran (reset the worker to recover)."""
