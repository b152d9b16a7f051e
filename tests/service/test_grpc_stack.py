"""The service plumbing of an in-process stack (tests.helpers.stack): health, reflection, the
Executor API's step ordering, a dead engine loop."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from protos.pagedserve.v1 import executor_pb2, executor_pb2_grpc
from tests.helpers.stack import Stack, health


@pytest.fixture(scope="module")
def stack(tiny_llama_dir):
    with Stack(tiny_llama_dir) as running:
        yield running


def test_health_is_serving_on_both_services(stack):
    assert health(stack.target, "") == "SERVING"
    assert health(stack.target, "pagedserve.v1.Generation") == "SERVING"
    assert health(stack.executor_target, "") == "SERVING"
    assert health(stack.executor_target, "pagedserve.v1.Executor") == "SERVING"
    with pytest.raises(grpc.RpcError) as info:
        health(stack.target, "no.such.Service")
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
    from scheduler_svc.engine.api import ExecutorError
    from scheduler_svc.engine.executor_client import ExecutorPool
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


def test_executor_runs_its_cache_ready_hook_after_each_init_cache(tiny_llama_dir):
    """The executor process freezes its start-up heap (freeze_startup_heap) once the cache and the
    graphs exist: the hook runs after every InitCache, and not before the cache is there."""
    seen = []

    async def scenario() -> None:
        from executor_svc.server.main import start_executor_server
        from executor_svc.worker.worker import Worker, WorkerConfig

        worker = Worker(
            WorkerConfig(model_dir=str(tiny_llama_dir), device="cpu", num_gpu_blocks=8, num_cpu_blocks=0)
        )
        server, port = await start_executor_server(
            worker, on_cache_ready=lambda: seen.append(worker.runner is not None))
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = executor_pb2_grpc.ExecutorStub(channel)
                assert seen == []
                await stub.InitCache(executor_pb2.InitCacheRequest(num_gpu_blocks=6, num_cpu_blocks=0))
                assert seen == [True]
                await stub.InitCache(executor_pb2.InitCacheRequest(num_gpu_blocks=8, num_cpu_blocks=0))
                assert seen == [True, True]
        finally:
            await server.stop(0)

    asyncio.run(scenario())


def test_freeze_startup_heap_takes_the_live_objects_out_of_collections():
    """In a fresh process (the test's own would stay frozen): after it, the objects alive then are
    in the permanent generation and young collections are rarer; calling it again collects what
    died frozen."""
    import subprocess
    import sys

    from scheduler_svc.wire.collector import GC_GEN0_THRESHOLD

    code = ("import gc, json, weakref; import grpc\n"
            "from scheduler_svc.wire.collector import freeze_startup_heap\n"
            "class Node: pass\n"
            "a, b = Node(), Node(); a.other, b.other = b, a; alive = weakref.ref(a)\n"
            "before = gc.get_freeze_count(); freeze_startup_heap(); frozen = gc.get_freeze_count()\n"
            "del a, b; gc.collect(); kept = alive() is not None\n"
            "freeze_startup_heap()\n"
            "print(json.dumps([before, frozen, gc.get_threshold(), kept, alive() is not None]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    before, frozen, thresholds, kept, still = __import__("json").loads(out)
    assert before == 0 and frozen > 10_000 and thresholds == [GC_GEN0_THRESHOLD, 10, 10]
    # a frozen cycle that dies is not collected while frozen; the next freeze collects it first
    assert kept and not still
