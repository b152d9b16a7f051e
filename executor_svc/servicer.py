"""The Executor gRPC service: converts protobuf ↔ plans/results and calls the Worker; nothing else."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc

from executor_svc.convert import describe_to_pb
from protos.pagedserve.v1 import executor_pb2, executor_pb2_grpc
from scheduler_svc.convert import maps_errors, step_plan_from_pb, step_result_to_pb


class StepOrderError(RuntimeError):
    """Fallback type when the worker module defines none (a plan that skips a step)."""


def _error_codes() -> dict[type[BaseException], grpc.StatusCode]:
    codes: dict[type[BaseException], grpc.StatusCode] = {StepOrderError: grpc.StatusCode.FAILED_PRECONDITION}
    try:
        from executor_svc import worker as worker_module
    except ImportError:
        return codes
    for name in ("StepOrderError", "PlanOrderError", "StepMismatchError"):
        if isinstance(cls := getattr(worker_module, name, None), type):
            codes[cls] = grpc.StatusCode.FAILED_PRECONDITION
    codes[ValueError] = grpc.StatusCode.INVALID_ARGUMENT
    return codes


ERROR_CODES = _error_codes()


class ExecutorServicer(executor_pb2_grpc.ExecutorServicer):
    """One rank. Calls run in a worker thread, one at a time, so the event loop keeps answering
    health checks while the model runs."""

    def __init__(self, worker: Any):
        self._worker = worker
        self._lock = asyncio.Lock()

    async def _call(self, fn, *args):
        async with self._lock:
            return await asyncio.to_thread(fn, *args)

    @maps_errors(ERROR_CODES)
    async def Describe(self, request, context):
        return describe_to_pb(await self._call(self._worker.describe))

    @maps_errors(ERROR_CODES)
    async def InitCache(self, request, context):
        await self._call(self._worker.init_cache, request.num_gpu_blocks, request.num_cpu_blocks)
        return executor_pb2.InitCacheResponse()

    @maps_errors(ERROR_CODES)
    async def Step(self, request, context):
        plan = step_plan_from_pb(request)
        return step_result_to_pb(await self._call(self._worker.execute, plan))

    @maps_errors(ERROR_CODES)
    async def Reset(self, request, context):
        await self._call(self._worker.reset)
        return executor_pb2.ResetResponse()
