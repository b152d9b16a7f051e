"""Prometheus metrics of the scheduler, named in vLLM's style with our own prefix.

Each `SchedulerMetrics` owns its registry (no process-global state), so several engines in one
process (tests) do not collide. The engine feeds it plain numbers; this module knows nothing of the
scheduler's types. Counters fed from cumulative totals use `set_total`, which adds only the increase
since the last call, so a counter never goes backwards.
"""

from __future__ import annotations

from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import start_http_server

PREFIX = "pagedserve:"

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
                    1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 192, 256, 384, 512, 1024)
_BYTES_BUCKETS = (256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304)

# name -> (help, labels); the dashboard test checks every panel against these names.
GAUGES = {
    "gpu_blocks_total": ("KV cache blocks on the GPU", ()),
    "gpu_blocks_used": ("GPU KV blocks referenced by at least one sequence", ()),
    "gpu_blocks_free": ("GPU KV blocks in the free queue (includes cached-free)", ()),
    "gpu_blocks_cached_free": ("free GPU KV blocks that still hold a reusable prefix", ()),
    "cpu_swap_blocks_total": ("blocks of the CPU swap space", ()),
    "cpu_swap_blocks_used": ("CPU swap blocks holding swapped-out KV", ()),
    "kv_usage_ratio": ("used GPU KV blocks / total GPU KV blocks", ()),
    "blocks_saved_by_sharing": ("block references served by sharing (sum of refcount - 1)", ()),
    "num_requests_running": ("requests in the running queue", ()),
    "num_requests_waiting": ("requests in the waiting queue", ()),
    "num_requests_swapped": ("requests swapped out to CPU", ()),
}
COUNTERS = {
    "prefix_cache_queries_tokens": ("prompt tokens looked up in the prefix cache", ()),
    "prefix_cache_hits_tokens": ("prompt tokens served from the prefix cache", ()),
    "preemptions": ("preempted requests", ("mode",)),
    "swapped_in_blocks": ("blocks moved CPU -> GPU", ()),
    "swapped_out_blocks": ("blocks moved GPU -> CPU", ()),
    "cow_copies": ("copy-on-write block copies", ()),
    "prompt_tokens": ("prompt tokens computed (prefill)", ()),
    "generation_tokens": ("tokens generated", ()),
    "requests_finished": ("finished requests", ("reason",)),
}
HISTOGRAMS = {
    "time_to_first_token_seconds": ("arrival to first token", (), _LATENCY_BUCKETS),
    "inter_token_latency_seconds": ("time between two tokens of one sequence", (), _LATENCY_BUCKETS),
    "e2e_request_latency_seconds": ("arrival to finish", (), _E2E_BUCKETS),
    "request_queue_time_seconds": ("arrival to first scheduled", (), _E2E_BUCKETS),
    "step_time_seconds": ("one engine step: schedule + executors + process result", (), _LATENCY_BUCKETS),
    "batch_size": ("sequences scheduled in one step", (), _BATCH_BUCKETS),
    "step_plan_bytes": ("encoded size of one step plan", (), _BYTES_BUCKETS),
}


def exported_metric_names() -> set[str]:
    """Every series name a scrape can show (counters gain _total, histograms their suffixes)."""
    names = {PREFIX + n for n in GAUGES}
    names |= {PREFIX + n + "_total" for n in COUNTERS}
    for n in HISTOGRAMS:
        names |= {PREFIX + n + s for s in ("_bucket", "_sum", "_count")}
    return names


class SchedulerMetrics:
    def __init__(self, model_name: str = "") -> None:
        self.registry = CollectorRegistry()
        self.gauges = {
            n: Gauge(PREFIX + n, h, labelnames=labels, registry=self.registry)
            for n, (h, labels) in GAUGES.items()
        }
        self.counters = {
            n: Counter(PREFIX + n, h, labelnames=labels, registry=self.registry)
            for n, (h, labels) in COUNTERS.items()
        }
        self.histograms = {
            n: Histogram(PREFIX + n, h, labelnames=labels, buckets=b, registry=self.registry)
            for n, (h, labels, b) in HISTOGRAMS.items()
        }
        self._totals: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        self._http_server: WSGIServer | None = None

    def set(self, name: str, value: float) -> None:
        self.gauges[name].set(value)

    def inc(self, name: str, amount: float = 1.0, **labels: str) -> None:
        if amount <= 0:
            return
        counter = self.counters[name]
        (counter.labels(**labels) if labels else counter).inc(amount)

    def set_total(self, name: str, total: float, **labels: str) -> None:
        """Feed a cumulative total; the counter grows by the increase since the last call."""
        key = (name, tuple(sorted(labels.items())))
        previous = self._totals.get(key, 0.0)
        if total > previous:
            self.inc(name, total - previous, **labels)
            self._totals[key] = total

    def observe(self, name: str, value: float) -> None:
        self.histograms[name].observe(value)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def serve(self, port: int, addr: str = "0.0.0.0") -> int:
        """Serve /metrics over HTTP on `port` (0 picks a free port); returns the bound port."""
        server, _thread = start_http_server(port, addr=addr, registry=self.registry)
        self._http_server = server
        return server.server_address[1]

    @property
    def port(self) -> int | None:
        """The /metrics HTTP port, once `serve` ran."""
        return self._http_server.server_address[1] if self._http_server is not None else None

    def close(self) -> None:
        if self._http_server is not None:
            self._http_server.shutdown()
            self._http_server.server_close()
            self._http_server = None
