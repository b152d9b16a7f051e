"""The scheduler's /metrics: it parses as Prometheus text and its counters agree with what the test
did (tokens generated, requests finished, preemptions forced by a small cache, prefix-cache hits
of a shared prompt, latency histogram counts)."""

from __future__ import annotations

import asyncio
import threading
import urllib.request

import grpc
from prometheus_client.parser import text_string_to_metric_families

from clients.client import Client
from protos.pagedserve.v1 import executor_pb2, executor_pb2_grpc
from scheduler_svc.engine.metrics import PREFIX, exported_metric_names
from tests.helpers.stack import Stack
from tests.helpers.wait import wait_until


def scrape(port: int, prefix: str = PREFIX) -> dict[tuple[str, tuple], float]:
    """(sample name without the prefix, sorted labels) -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            assert sample.name.startswith(prefix), sample.name
            samples[(sample.name[len(prefix):], tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def value(samples, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def diff(after, before, name: str, **labels) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


def test_metrics_agree_with_the_requests_served(tiny_llama_dir):
    with Stack(tiny_llama_dir, num_gpu_blocks=12, num_cpu_blocks=0, metrics_port=0) as stack, \
            Client(stack.target) as client:
        port = stack.engine.metrics.port
        start = scrape(port)
        exported = exported_metric_names()
        assert {PREFIX + name for name, _ in start if not name.endswith("_created")} <= exported

        # 1. a prompt of 40 tokens twice: the second finds 2 full blocks (32 tokens) in the prefix cache
        shared = [(7 * i) % 500 + 3 for i in range(40)]
        for _ in range(2):
            out = client.generate(shared, max_tokens=5, temperature=0.0, ignore_eos=True).outputs[0]
            assert len(out.token_ids) == 5
        after_prefix = scrape(port)
        assert diff(after_prefix, start, "prefix_cache_hits_tokens_total") == 32
        assert diff(after_prefix, start, "prompt_tokens_total") == 40 + 8
        assert diff(after_prefix, start, "generation_tokens_total") == 10
        assert diff(after_prefix, start, "requests_finished_total", reason="length") == 2
        assert diff(after_prefix, start, "time_to_first_token_seconds_count") == 2
        assert diff(after_prefix, start, "request_queue_time_seconds_count") == 2
        assert diff(after_prefix, start, "inter_token_latency_seconds_count") == 2 * 4
        assert diff(after_prefix, start, "e2e_request_latency_seconds_count") == 2

        # 2. four requests of 5 blocks each in a 12-block cache: recompute preemptions
        preemptions_before = client.stats().num_preemptions
        results: list = [None] * 4

        def one(i: int) -> None:
            with Client(stack.target) as c:
                results[i] = c.generate([11 + i, 90, 91 + i, 3, 4], max_tokens=70, ignore_eos=True, seed=i)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        end = scrape(port)
        num_preempted = client.stats().num_preemptions - preemptions_before
        assert num_preempted > 0
        assert diff(end, after_prefix, "preemptions_total", mode="recompute") == num_preempted
        assert diff(end, after_prefix, "generation_tokens_total") == 4 * 70
        assert sum(len(r.outputs[0].token_ids) for r in results) == 4 * 70
        assert diff(end, after_prefix, "requests_finished_total", reason="length") == 4
        assert diff(end, after_prefix, "e2e_request_latency_seconds_count") == 4
        assert diff(end, after_prefix, "inter_token_latency_seconds_count") == 4 * 69
        # every prompt computed once, plus what recompute computed again (prompt + outputs so far)
        assert diff(end, after_prefix, "prompt_tokens_total") >= 4 * 5
        assert value(end, "gpu_blocks_total") == 12
        assert value(end, "gpu_blocks_used") == 0 and value(end, "kv_usage_ratio") == 0
        assert value(end, "num_requests_running") == 0 and value(end, "num_requests_waiting") == 0
        assert value(end, "step_time_seconds_count") > 0 and value(end, "step_plan_bytes_sum") > 0
        assert value(end, "batch_size_sum") > 0

        # 3. two parallel samples share the prompt's partial last block: copied on first write
        result = client.generate([1, 2, 3, 4, 5], n=2, max_tokens=3, seed=1, ignore_eos=True)
        assert [len(o.token_ids) for o in result.outputs] == [3, 3]
        shared = scrape(port)
        assert diff(shared, end, "cow_copies_total") >= 1
        assert diff(shared, end, "generation_tokens_total") == 6

        # 4. beam search: the returned beams' tokens count when the request finishes
        beams = client.generate([1, 2, 3, 4, 5], beam_width=2, max_tokens=4, ignore_eos=True).outputs
        after_beam = scrape(port)
        assert [len(o.token_ids) for o in beams] == [4, 4]
        assert diff(after_beam, shared, "generation_tokens_total") == 8
        shared = after_beam

        # 5. a stream the client leaves early counts as finished with reason abort
        stream = client.stream([5, 6, 7], max_tokens=150, ignore_eos=True)
        next(stream)
        stream.close()

        def counted() -> dict | None:  # the scrape once the abort is in it
            scraped = scrape(port)
            return scraped if diff(scraped, shared, "requests_finished_total", reason="abort") >= 1 else None

        cancelled = wait_until(counted, 10, 0.05, "the abort to be counted")
        assert diff(cancelled, shared, "requests_finished_total", reason="abort") == 1


def test_executor_metrics_report_steps_memory_and_kv_cache_bytes(tiny_llama_dir):
    from executor_svc.server.main import start_executor_server
    from executor_svc.server.metrics import PREFIX as EXECUTOR_PREFIX
    from executor_svc.server.metrics import ExecutorMetrics
    from executor_svc.server.metrics import exported_metric_names as executor_metric_names
    from executor_svc.worker.worker import Worker, WorkerConfig

    async def scenario():
        worker = Worker(WorkerConfig(model_dir=str(tiny_llama_dir), device="cpu", num_gpu_blocks=16,
                                     num_cpu_blocks=4))
        metrics = ExecutorMetrics(worker)
        port = metrics.serve(0)
        before = await asyncio.to_thread(scrape, port, EXECUTOR_PREFIX)
        server, executor_port = await start_executor_server(worker, metrics=metrics)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{executor_port}") as channel:
                stub = executor_pb2_grpc.ExecutorStub(channel)
                await stub.InitCache(executor_pb2.InitCacheRequest(num_gpu_blocks=16, num_cpu_blocks=4))
                for step_id in (1, 2, 3):
                    await stub.Step(executor_pb2.StepPlan(step_id=step_id))
            after = await asyncio.to_thread(scrape, port, EXECUTOR_PREFIX)
        finally:
            await server.stop(0)
            metrics.close()
        return before, after, worker.block_bytes

    before, after, block_bytes = asyncio.run(scenario())
    assert {EXECUTOR_PREFIX + n for n, _ in after if not n.endswith("_created")} <= executor_metric_names()
    assert value(before, "kv_cache_bytes", pool="gpu") == 0
    assert value(after, "kv_cache_bytes", pool="gpu") == 16 * block_bytes > 0
    assert value(after, "kv_cache_bytes", pool="cpu_swap") == 4 * block_bytes
    assert value(after, "steps_total") == 3 and value(after, "step_time_seconds_count") == 3
    assert value(after, "cpu_memory_rss_bytes") > 10 << 20
    assert value(after, "gpu_memory_allocated_bytes") == 0  # a CPU executor
