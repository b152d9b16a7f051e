"""Prometheus metrics of one executor rank, served on its own /metrics (`--metrics-port`), with
/health like the scheduler's (scheduler_svc/wire/metrics_http.py).

Names follow the scheduler's conventions (scheduler_svc/engine/metrics.py): `pagedserve_executor_...`,
base units, a `model_name` label on every series. Step time and step count are fed by the servicer,
the pauses of the process's garbage collections (by generation) by gc.callbacks while it serves;
memory gauges are read at scrape time: GPU memory allocated and reserved by torch's caching
allocator (0 on a CPU executor) and the bytes of the KV cache (the device cache and the CPU swap
space) once InitCache allocated it (from the worker's `memory_usage()`). The process's CPU seconds
and resident memory are prometheus-client's ProcessCollector's (`process_cpu_seconds_total`,
`process_resident_memory_bytes`). Each `ExecutorMetrics` owns its registry (no process-global state).
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest

from executor_svc.worker.protocol import ReportsMemory
from scheduler_svc.wire.collector import GC_GENERATIONS, GC_PAUSE_BUCKETS, watch_gc_pauses
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
    "gc_pause_seconds": ("one garbage collection of the executor process (no step is launched "
                         "meanwhile), by generation", ("generation",), GC_PAUSE_BUCKETS),
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
        help_text, _, buckets = HISTOGRAMS["gc_pause_seconds"]
        gc_pause = Histogram(PREFIX + "gc_pause_seconds", help_text, ("model_name", "generation"),
                             buckets=buckets, registry=self.registry)
        self._gc_pauses = [gc_pause.labels(generation=g, **model) for g in GC_GENERATIONS]
        self._stop_gc_watch: Callable[[], None] | None = None
        self._http: MetricsHttpServer | None = None

    def observe_step(self, seconds: float) -> None:
        self._steps.inc()
        self._step_time.observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def serve(self, port: int, addr: str = "127.0.0.1") -> int:
        """Serve /metrics and /health over HTTP on `port` (0 picks a free port); returns the bound
        port. /health answers 503 until `watch_health` gives it the gRPC health. From now until
        `close`, every garbage collection of this process is timed (gc_pause_seconds)."""
        self._http = MetricsHttpServer(self.registry, port, addr)
        if self._stop_gc_watch is None:
            self._stop_gc_watch = watch_gc_pauses(self.observe_gc_pause)
        return self._http.port

    def observe_gc_pause(self, generation: int, seconds: float) -> None:
        self._gc_pauses[generation].observe(seconds)

    def watch_health(self, health: HealthState) -> None:
        """/health, /readyz and /healthz answer from `health` (the gRPC server's) from now on."""
        if self._http is not None:
            self._http.health = health

    def close(self) -> None:
        if self._stop_gc_watch is not None:
            self._stop_gc_watch()
            self._stop_gc_watch = None
        if self._http is not None:
            self._http.close()
            self._http = None
