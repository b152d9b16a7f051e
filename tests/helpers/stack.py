"""A real pagedserve stack on localhost, in-process: an executor server and a scheduler server,
each a grpc.aio server, in one background event loop."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import replace

import grpc
import pytest

EXECUTOR_TOKEN = "stack-executor-token"  # the executor credential of the in-process stack


class Stack:
    """`with Stack(model_dir, num_gpu_blocks=...) as stack:` serves on `stack.target`; the scheduler
    presents EXECUTOR_TOKEN to the executor, which checks it."""

    def __init__(self, model_dir, num_gpu_blocks: int = 256, num_cpu_blocks: int = 256, **options):
        self.model_dir = str(model_dir)
        self.num_gpu_blocks = num_gpu_blocks
        self.num_cpu_blocks = num_cpu_blocks
        self.serve_kwargs = options.pop("serve_kwargs", {})  # start_scheduler_server's (TLS, auth)
        self.options = options
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def run(self, coro, timeout_s: float = 120.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    async def _start(self) -> None:
        from executor_svc.server.main import start_executor_server
        from executor_svc.worker.worker import Worker, WorkerConfig
        from scheduler_svc.server.main import ServeOptions, build_engine, start_scheduler_server

        worker = Worker(
            WorkerConfig(
                model_dir=self.model_dir,
                device="cpu",
                num_gpu_blocks=self.num_gpu_blocks,
                num_cpu_blocks=self.num_cpu_blocks,
            )
        )
        self.executor_server, port = await start_executor_server(worker, auth_token=EXECUTOR_TOKEN)
        self.executor_target = f"127.0.0.1:{port}"
        opts = ServeOptions(model=self.model_dir, executors=(self.executor_target,), port=0,
                            executor_token=EXECUTOR_TOKEN)
        self.engine = await build_engine(replace(opts, **self.options))
        self.scheduler = await start_scheduler_server(self.engine, "127.0.0.1", 0, **self.serve_kwargs)
        self.target = f"127.0.0.1:{self.scheduler.port}"

    async def _stop(self) -> None:
        await self.scheduler.stop(0.5)
        await self.executor_server.stop(0.5)

    def __enter__(self) -> Stack:
        self._thread.start()
        self.run(self._start())
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.run(self._stop())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
            self.loop.close()

    def schedule_together(self, num_requests: int) -> None:
        """The engine takes no step until `num_requests` requests wait in its queue; then it runs as
        usual. A test that needs requests to share the cache (to force preemption, say) calls this
        before sending them, so how far apart they arrive cannot decide what the test sees."""
        scheduler = self.engine.scheduler
        real = scheduler.has_unfinished

        def gated() -> bool:
            if scheduler.stats().num_waiting < num_requests:
                return False  # the engine waits for the next request's wake-up
            del scheduler.has_unfinished  # back to the class's method
            return real()

        async def install() -> None:
            scheduler.has_unfinished = gated  # type: ignore[method-assign]

        self.run(install())

    def num_waiting(self) -> int:
        """Requests in the scheduler's waiting queue (read on the engine's loop)."""

        async def read() -> int:
            return self.engine.scheduler.stats().num_waiting

        return self.run(read())

    async def submit_in_order(self, coros: list) -> list:
        """Awaits `coros` (requests to this stack), each sent only once the one before it waits in the
        scheduler's queue: with `schedule_together(len(coros))` the queue's FCFS order is the list's,
        not whichever RPC reached the server first (which made how often a small cache preempts vary
        from run to run: 0, 1 or 2 preemptions for the same six requests)."""
        loop = asyncio.get_running_loop()
        tasks = []
        for i, coro in enumerate(coros):
            tasks.append(asyncio.ensure_future(coro))
            while await loop.run_in_executor(None, self.num_waiting) < i + 1:
                if tasks[-1].done():  # failed before it was queued: let gather raise it
                    break
                await asyncio.sleep(0.005)
        return await asyncio.gather(*tasks)

    def check_integrity(self) -> None:
        """The scheduler's block manager invariants (run on the engine's loop, between steps)."""

        async def check() -> None:
            self.engine.scheduler.kv.check_integrity()  # type: ignore[attr-defined]  # the real Scheduler

        self.run(check())


def health(target: str, service: str) -> str:
    """The grpc.health.v1 status name `target` reports for `service` (raises grpc.RpcError)."""
    health_pb2 = pytest.importorskip("grpc_health.v1.health_pb2")
    health_pb2_grpc = pytest.importorskip("grpc_health.v1.health_pb2_grpc")
    with grpc.insecure_channel(target) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=5
        )
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
