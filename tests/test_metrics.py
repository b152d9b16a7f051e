"""The scheduler's /metrics: it parses as Prometheus text and its counters agree with what the test
did (tokens generated, requests finished, preemptions forced by a small cache, prefix-cache hits
of a shared prompt, latency histogram counts)."""

from __future__ import annotations

import threading
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from clients.client import Client
from scheduler_svc.metrics import PREFIX, exported_metric_names
from tests.test_grpc_stack import Stack


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """(sample name without the prefix, sorted labels) -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            assert sample.name.startswith(PREFIX), sample.name
            samples[(sample.name[len(PREFIX):], tuple(sorted(sample.labels.items())))] = sample.value
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
