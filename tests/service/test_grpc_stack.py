"""A real pagedserve stack on localhost for the gRPC tests (executor server + scheduler server, each a
grpc.aio server, in one background event loop), and the tests of the service plumbing itself:
health, reflection, the Executor API's step ordering."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import replace

import grpc
import pytest

from protos.pagedserve.v1 import executor_pb2, executor_pb2_grpc


class Stack:
    """`with Stack(model_dir, num_gpu_blocks=...) as stack:` serves on `stack.target`."""

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
        self.executor_server, port = await start_executor_server(worker)
        self.executor_target = f"127.0.0.1:{port}"
        opts = ServeOptions(model=self.model_dir, executors=(self.executor_target,), port=0)
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

    def check_integrity(self) -> None:
        """The scheduler's block manager invariants (run on the engine's loop, between steps)."""

        async def check() -> None:
            self.engine.scheduler.kv.check_integrity()

        self.run(check())


@pytest.fixture(scope="module")
def stack(tiny_llama_dir):
    with Stack(tiny_llama_dir) as running:
        yield running


def _health(target: str, service: str) -> str:
    health_pb2 = pytest.importorskip("grpc_health.v1.health_pb2")
    health_pb2_grpc = pytest.importorskip("grpc_health.v1.health_pb2_grpc")
    with grpc.insecure_channel(target) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=5
        )
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def test_health_is_serving_on_both_services(stack):
    assert _health(stack.target, "") == "SERVING"
    assert _health(stack.target, "pagedserve.v1.Generation") == "SERVING"
    assert _health(stack.executor_target, "") == "SERVING"
    assert _health(stack.executor_target, "pagedserve.v1.Executor") == "SERVING"
    with pytest.raises(grpc.RpcError) as info:
        _health(stack.target, "no.such.Service")
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


def test_reflection_lists_the_services(stack):
    reflection_pb2 = pytest.importorskip("grpc_reflection.v1alpha.reflection_pb2")
    reflection_grpc = pytest.importorskip("grpc_reflection.v1alpha.reflection_pb2_grpc")
    with grpc.insecure_channel(stack.target) as channel:
        stub = reflection_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        reply = next(iter(stub.ServerReflectionInfo(iter([request]), timeout=5)))
    names = {s.name for s in reply.list_services_response.service}
    assert "pagedserve.v1.Generation" in names and "grpc.health.v1.Health" in names


def test_executor_rejects_a_plan_that_skips_a_step(tiny_llama_dir):
    async def scenario() -> tuple[grpc.StatusCode, str, int]:
        from executor_svc.server.main import start_executor_server
        from executor_svc.worker.worker import Worker, WorkerConfig

        worker = Worker(
            WorkerConfig(model_dir=str(tiny_llama_dir), device="cpu", num_gpu_blocks=8, num_cpu_blocks=0)
        )
        server, port = await start_executor_server(worker)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = executor_pb2_grpc.ExecutorStub(channel)
                await stub.Step(executor_pb2.StepPlan(step_id=1))
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await stub.Step(executor_pb2.StepPlan(step_id=3))
                await stub.Reset(executor_pb2.ResetRequest())
                after_reset = await stub.Step(executor_pb2.StepPlan(step_id=7))
                described = await stub.Describe(executor_pb2.DescribeRequest())
                assert described.vocab_size == 512 and described.num_gpu_blocks == 8
            return info.value.code(), info.value.details(), after_reset.step_id
        finally:
            await server.stop(0)

    code, details, step_after_reset = asyncio.run(scenario())
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert "step 3 does not follow step 1" in details
    assert step_after_reset == 7


def test_the_pool_steps_over_one_stream_and_reopens_it_after_an_error(tiny_llama_dir):
    """ExecutorPool drives a rank through StepStream: a plan that skips a step ends that stream
    with FAILED_PRECONDITION (as the unary Step would), and after a reset the next step opens a
    new stream and runs."""
    from scheduler_svc.engine.executor_client import ExecutorError, ExecutorPool
    from scheduler_svc.wire.step_plan import StepPlan

    async def scenario():
        from executor_svc.server.main import start_executor_server
        from executor_svc.worker.worker import Worker, WorkerConfig

        worker = Worker(
            WorkerConfig(model_dir=str(tiny_llama_dir), device="cpu", num_gpu_blocks=8, num_cpu_blocks=0)
        )
        server, port = await start_executor_server(worker)
        pool = ExecutorPool([f"127.0.0.1:{port}"])
        try:
            ids = [(await pool.step(StepPlan(step_id=i))).step_id for i in (1, 2, 3)]
            first_stream = pool._streams[0]
            with pytest.raises(ExecutorError) as info:
                await pool.step(StepPlan(step_id=9))
            dropped = pool._streams[0] is None
            await pool.reset()
            after = (await pool.step(StepPlan(step_id=1))).step_id
            return ids, first_stream, dropped, info.value.code, str(info.value), pool._streams[0], after
        finally:
            await pool.close()
            await server.stop(0)

    ids, first_stream, dropped, code, message, new_stream, after = asyncio.run(scenario())
    assert ids == [1, 2, 3] and first_stream is not None
    assert code == "FAILED_PRECONDITION" and "step 9 does not follow step 3" in message
    assert dropped and new_stream is not None and new_stream is not first_stream
    assert after == 1


def test_a_dead_engine_loop_fails_requests_instead_of_hanging(tiny_llama_dir):
    from clients.client import Client

    with Stack(tiny_llama_dir, num_gpu_blocks=16, num_cpu_blocks=0) as stack, Client(stack.target) as client:
        stream = client.stream([5, 6, 7], max_tokens=200, ignore_eos=True)
        next(stream)

        def broken_schedule():
            raise RuntimeError("scheduler bug")

        stack.engine.scheduler.schedule = broken_schedule
        with pytest.raises(grpc.RpcError) as info:
            list(stream)
        assert info.value.code() == grpc.StatusCode.ABORTED
        assert "engine failure: scheduler bug" in info.value.details()
        with pytest.raises(grpc.RpcError) as info:
            client.generate([1, 2, 3])
        assert info.value.code() == grpc.StatusCode.ABORTED
