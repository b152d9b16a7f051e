"""Prometheus metrics of one executor rank, served on its own /metrics (`--metrics-port`).

Step time and step count are fed by the servicer; memory gauges are read at scrape time: GPU
memory allocated and reserved by torch's caching allocator (0 on a CPU executor), the process's
resident CPU memory, and the bytes of the KV cache (the device cache and the CPU swap space) once
InitCache allocated it (all but the CPU memory from the worker's `memory_usage()`). Each
`ExecutorMetrics` owns its registry (no process-global state).
"""

from __future__ import annotations

import os
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import start_http_server

from executor_svc.worker.protocol import ReportsMemory

PREFIX = "pagedserve:executor_"

_STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0,
                 2.5, 5.0, 10.0)

# name -> (help, labels); the dashboard test checks every executor panel against these names.
GAUGES = {
    "gpu_memory_allocated_bytes": ("GPU memory held by tensors (torch caching allocator)", ()),
    "gpu_memory_reserved_bytes": ("GPU memory reserved by torch's caching allocator", ()),
    "cpu_memory_rss_bytes": ("resident CPU memory of the executor process", ()),
    "kv_cache_bytes": ("bytes of the KV cache: pool=gpu (the device cache) or cpu_swap", ("pool",)),
}
COUNTERS = {"steps": ("step plans executed", ())}
HISTOGRAMS = {
    "step_time_seconds": ("one Step call: decode plan, block ops, forward, sample", (), _STEP_BUCKETS),
}


def exported_metric_names() -> set[str]:
    names = {PREFIX + n for n in GAUGES} | {PREFIX + n + "_total" for n in COUNTERS}
    for n in HISTOGRAMS:
        names |= {PREFIX + n + s for s in ("_bucket", "_sum", "_count")}
    return names


def _rss_bytes() -> float:
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0.0


class ExecutorMetrics:
    def __init__(self, worker: ReportsMemory):
        self.registry = CollectorRegistry()
        gauges = {n: Gauge(PREFIX + n, h, labelnames=labels, registry=self.registry)
                  for n, (h, labels) in GAUGES.items()}
        gauges["gpu_memory_allocated_bytes"].set_function(lambda: worker.memory_usage().gpu_allocated_bytes)
        gauges["gpu_memory_reserved_bytes"].set_function(lambda: worker.memory_usage().gpu_reserved_bytes)
        gauges["cpu_memory_rss_bytes"].set_function(_rss_bytes)
        kv_bytes = gauges["kv_cache_bytes"]
        kv_bytes.labels(pool="gpu").set_function(lambda: worker.memory_usage().kv_cache_gpu_bytes)
        kv_bytes.labels(pool="cpu_swap").set_function(lambda: worker.memory_usage().kv_cache_cpu_bytes)
        self._steps = Counter(PREFIX + "steps", COUNTERS["steps"][0], registry=self.registry)
        help_text, _, buckets = HISTOGRAMS["step_time_seconds"]
        self._step_time = Histogram(PREFIX + "step_time_seconds", help_text, buckets=buckets,
                                    registry=self.registry)
        self._http_server: WSGIServer | None = None

    def observe_step(self, seconds: float) -> None:
        self._steps.inc()
        self._step_time.observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def serve(self, port: int, addr: str = "127.0.0.1") -> int:
        """Serve /metrics over HTTP on `port` (0 picks a free port); returns the bound port."""
        server, _thread = start_http_server(port, addr=addr, registry=self.registry)
        self._http_server = server
        return server.server_address[1]

    def close(self) -> None:
        if self._http_server is not None:
            self._http_server.shutdown()
            self._http_server.server_close()
            self._http_server = None
