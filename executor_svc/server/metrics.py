"""Prometheus metrics of one executor rank, served on its own /metrics (`--metrics-port`), with
/health like the scheduler's (scheduler_svc/wire/metrics_http.py).

Names follow the scheduler's conventions (scheduler_svc/engine/metrics.py): `pagedserve_executor_...`,
base units, a `model_name` label on every series. Step time and step count are fed by the servicer;
memory gauges are read at scrape time: GPU memory allocated and reserved by torch's caching
allocator (0 on a CPU executor) and the bytes of the KV cache (the device cache and the CPU swap
space) once InitCache allocated it (from the worker's `memory_usage()`). The process's CPU seconds
and resident memory are prometheus-client's ProcessCollector's (`process_cpu_seconds_total`,
`process_resident_memory_bytes`). Each `ExecutorMetrics` owns its registry (no process-global state).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest

from executor_svc.worker.protocol import ReportsMemory
from scheduler_svc.wire.metrics_http import HealthState, MetricsHttpServer

PREFIX = "pagedserve_executor_"
PROCESS_METRICS = ("process_cpu_seconds_total", "process_resident_memory_bytes",
                   "process_virtual_memory_bytes", "process_start_time_seconds", "process_open_fds",
                   "process_max_fds")

_STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0,
                 2.5, 5.0, 10.0)

# name -> (help, labels besides model_name); the dashboard tests check every executor panel against these.
GAUGES = {
    "gpu_memory_allocated_bytes": ("GPU memory held by tensors (torch caching allocator)", ()),
    "gpu_memory_reserved_bytes": ("GPU memory reserved by torch's caching allocator", ()),
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
    return names | set(PROCESS_METRICS)


class ExecutorMetrics:
    def __init__(self, worker: ReportsMemory, model_name: str = ""):
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        gauges = {n: Gauge(PREFIX + n, h, ("model_name", *labels), registry=self.registry)
                  for n, (h, labels) in GAUGES.items()}
        model = {"model_name": model_name}
        gauges["gpu_memory_allocated_bytes"].labels(**model).set_function(
            lambda: worker.memory_usage().gpu_allocated_bytes)
        gauges["gpu_memory_reserved_bytes"].labels(**model).set_function(
            lambda: worker.memory_usage().gpu_reserved_bytes)
        kv_bytes = gauges["kv_cache_bytes"]
        kv_bytes.labels(pool="gpu", **model).set_function(lambda: worker.memory_usage().kv_cache_gpu_bytes)
        kv_bytes.labels(pool="cpu_swap", **model).set_function(
            lambda: worker.memory_usage().kv_cache_cpu_bytes)
        steps = Counter(PREFIX + "steps", COUNTERS["steps"][0], ("model_name",), registry=self.registry)
        self._steps = steps.labels(**model)
        help_text, _, buckets = HISTOGRAMS["step_time_seconds"]
        step_time = Histogram(PREFIX + "step_time_seconds", help_text, ("model_name",), buckets=buckets,
                              registry=self.registry)
        self._step_time = step_time.labels(**model)
        self._http: MetricsHttpServer | None = None

    def observe_step(self, seconds: float) -> None:
        self._steps.inc()
        self._step_time.observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def serve(self, port: int, addr: str = "127.0.0.1") -> int:
        """Serve /metrics and /health over HTTP on `port` (0 picks a free port); returns the bound
        port. /health answers 503 until `watch_health` gives it the gRPC health."""
        self._http = MetricsHttpServer(self.registry, port, addr)
        return self._http.port

    def watch_health(self, health: HealthState) -> None:
        """/health, /readyz and /healthz answer from `health` (the gRPC server's) from now on."""
        if self._http is not None:
            self._http.health = health

    def close(self) -> None:
        if self._http is not None:
            self._http.close()
            self._http = None
