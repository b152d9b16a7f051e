"""requests_rejected_total counts whatever status a call is answered with: maps_errors (the one
error mapping) tells a servicer that CountsErrors each code, for unary and streaming methods,
ApiErrors, caller-mapped errors and INTERNAL alike; a call that succeeds counts nothing."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from scheduler_svc.engine.metrics import SchedulerMetrics
from scheduler_svc.wire.convert import CountsErrors, maps_errors
from scheduler_svc.wire.errors import InvalidRequestError, ServiceUnavailableError


class Context:
    def __init__(self) -> None:
        self.aborted: tuple[grpc.StatusCode, str] | None = None

    async def abort(self, code: grpc.StatusCode, message: str, trailing_metadata=()) -> None:
        self.aborted = (code, message)
        raise grpc.aio.AbortError()


class Servicer:
    def __init__(self) -> None:
        self.metrics = SchedulerMetrics("m")

    def count_error(self, code: grpc.StatusCode) -> None:
        self.metrics.count_rejected(code.name)

    @maps_errors({KeyError: "NOT_FOUND"})
    async def Unary(self, request, context):
        if isinstance(request, BaseException):
            raise request
        return "ok"

    @maps_errors()
    async def Stream(self, request, context):
        yield 1
        raise request


def rejected(metrics: SchedulerMetrics, code: str) -> float:
    value = metrics.registry.get_sample_value(
        "pagedserve_requests_rejected_total", {"model_name": "m", "api": "grpc", "code": code})
    return value or 0.0


def test_every_error_status_is_counted_by_code():
    servicer = Servicer()
    assert isinstance(servicer, CountsErrors)

    async def call(request, stream: bool = False) -> Context:
        context = Context()
        with pytest.raises(grpc.aio.AbortError):
            if stream:
                async for _ in servicer.Stream(request, context):
                    pass
            else:
                await servicer.Unary(request, context)
        return context

    async def scenario() -> list[Context]:
        assert await servicer.Unary("fine", Context()) == "ok"
        return [await call(InvalidRequestError("n", "too large")), await call(KeyError("x")),
                await call(ValueError("bug")), await call(ServiceUnavailableError("draining"), stream=True),
                await call(InvalidRequestError("max_tokens", "too large"), stream=True)]

    contexts = asyncio.run(scenario())
    codes = [c.aborted[0].name for c in contexts]
    assert codes == ["INVALID_ARGUMENT", "NOT_FOUND", "INTERNAL", "UNAVAILABLE", "INVALID_ARGUMENT"]
    m = servicer.metrics
    assert [rejected(m, c) for c in ("INVALID_ARGUMENT", "NOT_FOUND", "INTERNAL", "UNAVAILABLE",
                                     "RESOURCE_EXHAUSTED")] == [2, 1, 1, 1, 0]


def test_a_servicer_that_does_not_count_still_gets_its_status():
    class Plain:
        @maps_errors()
        async def Unary(self, request, context):
            raise InvalidRequestError("prompt", "empty")

    context = Context()
    with pytest.raises(grpc.aio.AbortError):
        asyncio.run(Plain().Unary(None, context))
    assert context.aborted == (grpc.StatusCode.INVALID_ARGUMENT, "prompt: empty")
