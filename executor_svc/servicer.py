"""The Executor gRPC service: converts protobuf ↔ plans/results and calls the Worker; nothing else."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import grpc

from executor_svc.convert import describe_to_pb
from executor_svc.errors import PlanError, StepOrderError
from protos.pagedserve.v1 import executor_pb2, executor_pb2_grpc
from scheduler_svc.convert import maps_errors, step_plan_from_pb, step_result_to_pb

ERROR_CODES = {
    StepOrderError: grpc.StatusCode.FAILED_PRECONDITION,  # a plan that skips a step: reset first
    PlanError: grpc.StatusCode.INVALID_ARGUMENT,  # a plan naming unknown sequences or blocks
    ValueError: grpc.StatusCode.INVALID_ARGUMENT,  # e.g. init_cache with more blocks than fit
}


class ExecutorServicer(executor_pb2_grpc.ExecutorServicer):
    """One rank. Calls run in a worker thread, one at a time, so the event loop keeps answering
    health checks while the model runs. An error that is not the plan's fault (not in ERROR_CODES:
    e.g. a collective that failed because another rank died) is passed to `on_fatal` too."""

    def __init__(
        self, worker: Any, on_fatal: Callable[[BaseException], None] | None = None, metrics: Any = None
    ):
        self._worker = worker
        self._lock = asyncio.Lock()
        self._on_fatal = on_fatal
        self._metrics = metrics  # executor_svc.metrics.ExecutorMetrics, fed with each step's time

    async def _call(self, fn, *args):
        async with self._lock:
            try:
                return await asyncio.to_thread(fn, *args)
            except Exception as exc:
                if self._on_fatal is not None and not isinstance(exc, tuple(ERROR_CODES)):
                    self._on_fatal(exc)
                raise

    @maps_errors(ERROR_CODES)
    async def Describe(self, request, context):
        return describe_to_pb(await self._call(self._worker.describe))

    @maps_errors(ERROR_CODES)
    async def InitCache(self, request, context):
        await self._call(self._worker.init_cache, request.num_gpu_blocks, request.num_cpu_blocks)
        return executor_pb2.InitCacheResponse()

    @maps_errors(ERROR_CODES)
    async def Step(self, request, context):
        return await self._step(request)

    @maps_errors(ERROR_CODES)
    async def StepStream(self, request_iterator, context):
        async for request in request_iterator:
            yield await self._step(request)

    async def _step(self, request: executor_pb2.StepPlan) -> executor_pb2.StepResult:
        start = time.perf_counter()
        plan = step_plan_from_pb(request)
        reply = step_result_to_pb(await self._call(self._worker.execute, plan))
        if self._metrics is not None:
            self._metrics.observe_step(time.perf_counter() - start)
        return reply

    @maps_errors(ERROR_CODES)
    async def Reset(self, request, context):
        await self._call(self._worker.reset)
        return executor_pb2.ResetResponse()
