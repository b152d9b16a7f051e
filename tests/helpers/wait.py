"""The one polling loop of the tests, and health checks built on it."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")


class WaitTimeout(AssertionError):
    """What `wait_until` raises: a test failure that names what was waited for."""


def wait_until(
    predicate: Callable[[], T | None], timeout_s: float, interval_s: float = 0.05, what: str = "the condition"
) -> T:
    """Calls `predicate` every `interval_s` until it returns a truthy value, and returns that value;
    raises WaitTimeout (naming `what`) when `timeout_s` passes first. Exceptions of `predicate` pass
    through (a predicate fails fast by raising)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if value := predicate():
            return value
        if time.monotonic() >= deadline:
            raise WaitTimeout(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(interval_s)


def wait_health(target: str, wanted: str, timeout_s: float = 60.0, procs: Sequence = ()) -> str:
    """Polls grpc.health.v1 on `target` until it reports `wanted` or `timeout_s` passes, and returns
    the last status (the caller asserts on it); raises RuntimeError if one of `procs` exits first."""
    from scheduler_svc.wire.grpc_serving import health_status

    last = [""]

    def reached() -> bool:
        if any(p.poll() is not None for p in procs):
            raise RuntimeError(f"a process exited while waiting for {target} to be {wanted}")
        last[0] = health_status(target, timeout_s=1.0)
        return last[0] == wanted

    with contextlib.suppress(WaitTimeout):
        wait_until(reached, timeout_s, 0.1, f"{target} to be {wanted}")
    return last[0]
