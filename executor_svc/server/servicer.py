"""The Executor gRPC service: converts protobuf ↔ plans/results and calls the Worker; nothing else."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from executor_svc.worker.protocol import StepWorker
from protos.pagedserve.v1 import executor_pb2, executor_pb2_grpc
from scheduler_svc.wire.convert import (
    CallerErrors,
    description_to_pb,
    maps_errors,
    status_name,
    step_plan_from_pb,
    step_result_to_pb,
)

if TYPE_CHECKING:
    from executor_svc.server.metrics import ExecutorMetrics

# Besides the API's errors (PlanError, StepOrderError: the caller's fault, each with its own code), a
# ValueError of the worker is the call's fault too: e.g. init_cache with more blocks than fit.
CALLER_ERRORS: CallerErrors = {ValueError: "INVALID_ARGUMENT"}


class ExecutorServicer(executor_pb2_grpc.ExecutorServicer):
    """One rank. Calls run in a worker thread, one at a time, so the event loop keeps answering
    health checks while the model runs. An error that is not the caller's fault (an INTERNAL status:
    e.g. a collective that failed because another rank died) is passed to `on_fatal` too.
    `on_cache_ready` runs after each InitCache (the server freezes its start-up heap there)."""

    def __init__(
        self,
        worker: StepWorker[Any],
        on_fatal: Callable[[BaseException], None] | None = None,
        metrics: ExecutorMetrics | None = None,
        on_cache_ready: Callable[[], None] | None = None,
    ):
        self._worker = worker
        self._lock = asyncio.Lock()
        self._on_fatal = on_fatal
        self._metrics = metrics  # fed with each step's time
        self._on_cache_ready = on_cache_ready

    async def _call(self, fn, *args):
        """Runs fn in a worker thread, one call at a time. A cancelled RPC (the scheduler dropped its
        streams because another rank failed) cannot stop the thread: the call still waits for it,
        so the next call never runs beside it, and still reports a fatal error it ends with (a
        collective that failed when the other rank died), which would otherwise go unseen."""
        async with self._lock:
            work = asyncio.ensure_future(asyncio.to_thread(fn, *args))
            cancelled = False
            while not work.done():
                try:
                    await asyncio.wait({work})
                except asyncio.CancelledError:
                    cancelled = True
            exc = work.exception()
            on_fatal = self._on_fatal
            if exc is not None and on_fatal is not None and status_name(exc, CALLER_ERRORS) == "INTERNAL":
                on_fatal(exc)
            if cancelled:
                raise asyncio.CancelledError
            return work.result()

    @maps_errors(CALLER_ERRORS)
    async def Describe(self, request, context):
        return description_to_pb(await self._call(self._worker.describe))

    @maps_errors(CALLER_ERRORS)
    async def InitCache(self, request, context):
        await self._call(self._worker.init_cache, request.num_gpu_blocks, request.num_cpu_blocks)
        if self._on_cache_ready is not None:
            self._on_cache_ready()
        return executor_pb2.InitCacheResponse()

    @maps_errors(CALLER_ERRORS)
    async def Step(self, request, context):
        return await self._step(request)

    @maps_errors(CALLER_ERRORS)
    async def StepStream(self, request_iterator, context):
        """Plans in, results out, in order. When plan i+1 arrives while the GPU still runs step i
        (the scheduler plans ahead), step i+1 is launched before step i's result is collected, so
        the GPU goes from one step to the next without waiting for the host; a plan that arrives
        while steps are launched and unfinished (the scheduler two plans ahead) is launched behind
        them as well."""
        if not self._worker.launches_ahead:  # launch would run the step to the end: one at a time
            async for request in request_iterator:
                yield await self._step(request)
            return
        plans = aiter(request_iterator)
        next_plan = asyncio.ensure_future(anext(plans, None))
        launched: deque = deque()  # (step, start) launched, results not yet sent; oldest first
        try:
            while True:
                if not launched:
                    request = await next_plan
                    if request is None:
                        return
                    next_plan = asyncio.ensure_future(anext(plans, None))
                    launched.append(await self._launch(request))
                gpu_done = asyncio.ensure_future(asyncio.to_thread(self._worker.wait, launched[0][0]))
                await asyncio.wait({gpu_done, next_plan}, return_when=asyncio.FIRST_COMPLETED)
                while next_plan.done() and next_plan.result() is not None:
                    request = next_plan.result()
                    next_plan = asyncio.ensure_future(anext(plans, None))
                    launched.append(await self._launch(request))
                await gpu_done
                yield await self._finish(launched.popleft())
        finally:
            next_plan.cancel()

    async def _launch(self, request: executor_pb2.StepPlan):
        start = time.perf_counter()
        return await self._call(self._worker.launch, step_plan_from_pb(request)), start

    async def _finish(self, launched) -> executor_pb2.StepResult:
        step, start = launched
        reply = step_result_to_pb(await self._call(self._worker.finish, step))
        if self._metrics is not None:
            self._metrics.observe_step(time.perf_counter() - start)
        return reply

    async def _step(self, request: executor_pb2.StepPlan) -> executor_pb2.StepResult:
        start = time.perf_counter()
        plan = step_plan_from_pb(request)
        reply = step_result_to_pb(await self._call(self._worker.execute, plan))
        if self._metrics is not None:
            self._metrics.observe_step(time.perf_counter() - start)
        return reply

    @maps_errors(CALLER_ERRORS)
    async def Reset(self, request, context):
        await self._call(self._worker.reset)
        return executor_pb2.ResetResponse()
