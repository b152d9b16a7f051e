"""The scheduler's /metrics: it parses as Prometheus text and its counters agree with what the test
did (tokens generated, requests finished, preemptions forced by a small cache, prefix-cache hits
of a shared prompt, latency histogram counts, refused requests by code); the series names are the
same under the text format and OpenMetrics (what Prometheus asks for); every series carries
model_name; the process metrics are there; /health on the metrics port tells the gRPC health."""

from __future__ import annotations

import asyncio
import threading
import urllib.error
import urllib.request

import grpc
import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families

from clients.client import Client
from protos.pagedserve.v1 import (
    executor_pb2,
    executor_pb2_grpc,
    frontend_pb2,
    frontend_pb2_grpc,
    generation_pb2,
)
from scheduler_svc.engine.metrics import PREFIX, exported_metric_names
from tests.helpers.stack import Stack
from tests.helpers.wait import wait_until

OPENMETRICS = "application/openmetrics-text; version=1.0.0; charset=utf-8"
FIXED_LABELS = ("model_name", "api")


def fetch(port: int, accept: str | None = None, path: str = "/metrics") -> str:
    headers = {"Accept": accept} if accept else {}
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", headers=headers)
    with urllib.request.urlopen(request, timeout=10) as reply:
        return reply.read().decode()


def series_names(text: str, openmetrics: bool = False) -> set[str]:
    """Every sample's name (the _created series left out: a scrape option, not a metric)."""
    families = parse_openmetrics(text) if openmetrics else text_string_to_metric_families(text)
    return {s.name for f in families for s in f.samples if not s.name.endswith("_created")}


def scrape(port: int, prefix: str = PREFIX, model_name: str | None = None) -> dict[tuple[str, tuple], float]:
    """(sample name without the prefix, sorted labels but model_name and api) -> value; the process
    metrics under their own names. Every other series must carry `model_name` (when given)."""
    samples = {}
    for family in text_string_to_metric_families(fetch(port)):
        for sample in family.samples:
            if sample.name.startswith("process_"):
                samples[(sample.name, ())] = sample.value
                continue
            assert sample.name.startswith(prefix), sample.name
            if model_name is not None:
                assert sample.labels.get("model_name") == model_name, sample
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k not in FIXED_LABELS))
            samples[(sample.name[len(prefix):], labels)] = sample.value
    return samples


def http_status(port: int, path: str) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as reply:
            return reply.status
    except urllib.error.HTTPError as err:
        return err.code


def value(samples, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def diff(after, before, name: str, **labels) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


def test_metrics_agree_with_the_requests_served(tiny_llama_dir):
    with Stack(tiny_llama_dir, num_gpu_blocks=12, num_cpu_blocks=0, metrics_port=0) as stack, \
            Client(stack.target) as client:
        port = stack.engine.metrics.port
        model_name = stack.engine.limits.model_name
        start = scrape(port, model_name=model_name)
        exported = exported_metric_names()
        assert {name if name.startswith("process_") else PREFIX + name
                for name, _ in start if not name.endswith("_created")} <= exported
        assert value(start, "process_cpu_seconds_total") > 0
        assert value(start, "process_resident_memory_bytes") > 0

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
        assert value(end, "gpu_blocks_capacity") == 12
        assert value(end, "gpu_blocks_used") == 0 and value(end, "kv_usage_ratio") == 0
        assert value(end, "num_requests_running") == 0 and value(end, "num_requests_waiting") == 0
        assert value(end, "step_time_seconds_count") > 0 and value(end, "step_plan_bytes_sum") > 0
        assert value(end, "batch_size_sum") > 0
        assert value(end, "step_kv_usage_ratio_count") == value(end, "step_time_seconds_count")
        assert value(end, "step_kv_usage_ratio_sum") > 0  # the 12 blocks were in use

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

        # 6. refused requests count by their gRPC code (the one error mapping feeds the counter)
        for bad in ({"max_tokens": 10**9}, {"n": 10**6}, {"temperature": float("nan")}):
            with pytest.raises(grpc.RpcError) as refused:
                client.generate([1, 2, 3], **bad)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        rejected = scrape(port, model_name=model_name)
        assert diff(rejected, cancelled, "requests_rejected_total", code="INVALID_ARGUMENT") == 3
        assert value(rejected, "requests_rejected_total", code="RESOURCE_EXHAUSTED") == 0  # there from start
        assert diff(rejected, cancelled, "requests_finished_total", reason="length") == 0

        # 7. Prometheus asks for OpenMetrics: the same series names as the plain text format
        plain, openmetrics = fetch(port), fetch(port, OPENMETRICS)
        assert openmetrics.rstrip().endswith("# EOF") and not plain.rstrip().endswith("# EOF")
        assert series_names(plain) == series_names(openmetrics, openmetrics=True)
        assert not [n for n in series_names(plain) if ":" in n]
        assert 'api="grpc"' in plain and 'requests_finished_total{api="grpc",model_name=' in plain


def test_executor_metrics_report_steps_memory_and_kv_cache_bytes(tiny_llama_dir):
    from executor_svc.server.main import start_executor_server
    from executor_svc.server.metrics import PREFIX as EXECUTOR_PREFIX
    from executor_svc.server.metrics import ExecutorMetrics
    from executor_svc.server.metrics import exported_metric_names as executor_metric_names
    from executor_svc.worker.worker import Worker, WorkerConfig

    async def scenario():
        worker = Worker(WorkerConfig(model_dir=str(tiny_llama_dir), device="cpu", num_gpu_blocks=16,
                                     num_cpu_blocks=4))
        metrics = ExecutorMetrics(worker, "tiny-llama")
        port = metrics.serve(0)
        before = await asyncio.to_thread(scrape, port, EXECUTOR_PREFIX, "tiny-llama")
        starting = await asyncio.to_thread(http_status, port, "/health")
        server, executor_port = await start_executor_server(worker, metrics=metrics)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{executor_port}") as channel:
                stub = executor_pb2_grpc.ExecutorStub(channel)
                await stub.InitCache(executor_pb2.InitCacheRequest(num_gpu_blocks=16, num_cpu_blocks=4))
                for step_id in (1, 2, 3):
                    await stub.Step(executor_pb2.StepPlan(step_id=step_id))
            after = await asyncio.to_thread(scrape, port, EXECUTOR_PREFIX, "tiny-llama")
            serving = await asyncio.to_thread(http_status, port, "/health")
        finally:
            await server.stop(0)
            metrics.close()
        return before, after, worker.block_bytes, (starting, serving)

    before, after, block_bytes, health = asyncio.run(scenario())
    assert health == (503, 200)  # before the gRPC server serves, then SERVING
    assert {n if n.startswith("process_") else EXECUTOR_PREFIX + n
            for n, _ in after if not n.endswith("_created")} <= executor_metric_names()
    assert value(before, "kv_cache_bytes", pool="gpu") == 0
    assert value(after, "kv_cache_bytes", pool="gpu") == 16 * block_bytes > 0
    assert value(after, "kv_cache_bytes", pool="cpu_swap") == 4 * block_bytes
    assert value(after, "steps_total") == 3 and value(after, "step_time_seconds_count") == 3
    assert value(after, "process_resident_memory_bytes") > 10 << 20
    assert value(after, "process_cpu_seconds_total") > 0
    assert value(after, "gpu_memory_allocated_bytes") == 0  # a CPU executor


def test_health_on_the_metrics_port_follows_the_grpc_health(tiny_llama_dir):
    """/health and /readyz: 200 while SERVING, 503 while the executors are lost (recovering) and
    while draining; /healthz (liveness) stays 200; any other path is 404."""
    with Stack(tiny_llama_dir, num_gpu_blocks=32, num_cpu_blocks=0, metrics_port=0,
               recovery_timeout_s=30.0) as stack:
        port = stack.engine.metrics.port
        assert [http_status(port, p) for p in ("/health", "/readyz", "/healthz")] == [200, 200, 200]
        assert [http_status(port, p) for p in ("/", "/metricsx", "/health/x", "/favicon.ico")] == [404] * 4
        assert fetch(port, path="/health") == "SERVING\n"

        # recovering: the executor is gone, a request is waiting for it
        with Client(stack.target) as client:
            stream = client.stream([5, 6, 7], max_tokens=400, ignore_eos=True)
            next(stream)
            stack.run(stack.executor_server.stop(0))
            wait_until(lambda: http_status(port, "/health") == 503, 30, 0.05, "/health to say 503")
            assert http_status(port, "/readyz") == 503 and http_status(port, "/healthz") == 200
            assert fetch_error(port, "/health") == "NOT_SERVING\n"
            stream.close()

        # draining: health says NOT_SERVING at once, liveness stays
        stack.engine.on_health_change = None  # the executor stays down: only the drain moves health now
        stack.run(stack.scheduler.health.set_serving(True))
        assert http_status(port, "/health") == 200
        drained = asyncio.run_coroutine_threadsafe(stack.scheduler.drain_and_stop(0.2), stack.loop)
        wait_until(lambda: http_status(port, "/health") == 503, 10, 0.05, "/health to say 503 while draining")
        assert http_status(port, "/healthz") == 200
        drained.result(30)


def fetch_error(port: int, path: str) -> str:
    try:
        return fetch(port, path=path)
    except urllib.error.HTTPError as err:
        return err.read().decode()


class HttpFrontendStack(Stack):
    """A Stack behind an API front-end: gRPC on `target`, the OpenAI HTTP API on `http.port`, the
    scheduler itself (its FrontendLink) on `scheduler_target`."""

    async def _start(self) -> None:
        from scheduler_svc.frontend.http_app import start_http_api
        from scheduler_svc.frontend.main import start_frontend

        await super()._start()
        self.scheduler_target, links = self.target, []
        self.frontend, port, _, self.link_task = await start_frontend(self.target, on_link=links.append)
        self.http = await start_http_api(links[0], "127.0.0.1", 0, self.model_dir, None, None, None, None)
        self.target = f"127.0.0.1:{port}"

    async def _stop(self) -> None:
        await self.http.stop(0.5)
        await self.frontend.stop(0.5)
        self.link_task.cancel()
        await super()._stop()


def open_on_link(target: str, api: str) -> frontend_pb2.StreamEvent:
    """Opens one stream over a FrontendLink of its own, claiming `api`; its first event."""
    answered = threading.Event()

    def requests():
        request = generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=[1, 2, 3]))
        yield frontend_pb2.LinkRequest(open=frontend_pb2.OpenStream(stream_id=1, request=request, api=api))
        answered.wait(10)  # the link stays open until the answer came

    with grpc.insecure_channel(target) as channel:
        batches = frontend_pb2_grpc.FrontendLinkStub(channel).Streams(requests(), timeout=10)
        event = next(iter(batches)).events[0]
        answered.set()
        return event


def test_request_metrics_tell_the_grpc_api_from_the_openai_one(tiny_llama_dir):
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("uvicorn")
    with HttpFrontendStack(tiny_llama_dir, num_gpu_blocks=12, num_cpu_blocks=0, metrics_port=0) as stack:
        with Client(stack.target) as client:
            client.generate([1, 2, 3], max_tokens=3)
        body = {"model": stack.engine.limits.model_name, "prompt": [1, 2, 3], "max_tokens": 3}
        reply = httpx.post(f"http://127.0.0.1:{stack.http.port}/v1/completions", json=body, timeout=30)
        assert reply.status_code == 200
        # a link client claiming another api is refused; its refusal counts as grpc
        hostile = open_on_link(stack.scheduler_target, api="hostile")
        assert hostile.end and hostile.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert "api" in hostile.message
        families = list(text_string_to_metric_families(fetch(stack.engine.metrics.port)))

    samples = [s for f in families for s in f.samples if "api" in s.labels]
    assert {s.labels["api"] for s in samples} == {"grpc", "openai"}

    def total(name: str, api: str, **labels: str) -> float:
        return sum(s.value for s in samples if s.name == PREFIX + name and s.labels["api"] == api
                   and labels.items() <= s.labels.items())

    for api in ("grpc", "openai"):
        assert total("requests_finished_total", api) == 1, api
        assert total("generation_tokens_total", api) == 3, api
        assert total("e2e_request_latency_seconds_count", api) == 1, api
    assert total("requests_rejected_total", "grpc", code="INVALID_ARGUMENT") == 1
    assert total("requests_rejected_total", "openai") == 0


def test_both_processes_time_their_garbage_collections_while_they_serve_metrics(tiny_llama_dir):
    """gc_pause_seconds{generation}: every collection of the process is observed once /metrics is
    served, and no longer after close (the gc callback is removed: a test process creates many)."""
    import gc

    from executor_svc.server.metrics import ExecutorMetrics
    from executor_svc.worker.worker import Worker, WorkerConfig
    from scheduler_svc.engine.metrics import SchedulerMetrics

    worker = Worker(WorkerConfig(model_dir=str(tiny_llama_dir), device="cpu", num_gpu_blocks=4,
                                 num_cpu_blocks=0))
    for metrics, prefix in ((SchedulerMetrics("m"), PREFIX), (ExecutorMetrics(worker, "m"),
                                                                "pagedserve_executor_")):
        callbacks = len(gc.callbacks)
        port = metrics.serve(0)
        try:
            assert len(gc.callbacks) == callbacks + 1
            before = scrape(port, prefix, "m")
            gc.collect()
            gc.collect(0)
            after = scrape(port, prefix, "m")
            for generation in ("0", "2"):
                key = ("gc_pause_seconds_count", (("generation", generation),))
                assert after[key] >= before[key] + 1, generation
        finally:
            metrics.close()
        assert len(gc.callbacks) == callbacks
