"""Prometheus metrics of the scheduler, in Prometheus's naming conventions.

Every name is `pagedserve_<what>[_<unit>]` (no colons: those are for recording rules, and
prometheus-client >= 0.23 rewrites them under OpenMetrics, so the text format and OpenMetrics would
disagree), in base units (seconds, bytes; blocks, tokens and requests are counts), `_total` only on
counters. Every series carries `model_name`; the request-level ones also carry `api` (the API the
request came through, one of client_identity.APIS: "grpc" for the Generation API, direct or through
the API front-end, "openai" for the front-end's HTTP API).
The process's CPU seconds and memory come from prometheus-client's ProcessCollector
(`process_cpu_seconds_total`, `process_resident_memory_bytes`, ...: the standard names, no prefix).

Each `SchedulerMetrics` owns its registry (no process-global state), so several engines in one
process (tests) do not collide. The engine feeds it plain numbers; this module knows nothing of the
scheduler's types. Counters fed from cumulative totals use `set_total`, which adds only the increase
since the last call, so a counter never goes backwards. Series of the common label values (finish
reasons, preemption modes, refusal codes) exist from the start at 0, so a rate over them is 0
rather than no data.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest

from scheduler_svc.wire.client_identity import APIS, DEFAULT_API
from scheduler_svc.wire.collector import GC_GENERATIONS, GC_PAUSE_BUCKETS, watch_gc_pauses
from scheduler_svc.wire.metrics_http import HealthState, MetricsHttpServer

PREFIX = "pagedserve_"

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
                    1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)
_QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0,
                  120.0, 300.0, 600.0)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 192, 256, 384, 512, 1024)
_BYTES_BUCKETS = (256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304)
_RATIO_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0)

# name -> (help, labels besides model_name); the dashboard tests check every panel against these.
GAUGES: dict[str, tuple[str, tuple[str, ...]]] = {
    "gpu_blocks_capacity": ("KV cache blocks on the GPU", ()),
    "gpu_blocks_used": ("GPU KV blocks referenced by at least one sequence", ()),
    "gpu_blocks_free": ("GPU KV blocks in the free queue (includes cached-free)", ()),
    "gpu_blocks_cached_free": ("free GPU KV blocks that still hold a reusable prefix", ()),
    "cpu_swap_blocks_capacity": ("blocks of the CPU swap space", ()),
    "cpu_swap_blocks_used": ("CPU swap blocks holding swapped-out KV", ()),
    "kv_usage_ratio": ("used GPU KV blocks / GPU KV blocks, after the last step", ()),
    "blocks_saved_by_sharing": ("block references served by sharing (sum of refcount - 1)", ()),
    "num_requests_running": ("requests in the running queue", ()),
    "num_requests_waiting": ("requests in the waiting queue", ()),
    "num_requests_swapped": ("requests swapped out to CPU", ()),
}
COUNTERS: dict[str, tuple[str, tuple[str, ...]]] = {
    "prefix_cache_queries_tokens": ("prompt tokens looked up in the prefix cache", ()),
    "prefix_cache_hits_tokens": ("prompt tokens served from the prefix cache", ()),
    "preemptions": ("preempted requests", ("mode",)),
    "swapped_in_blocks": ("blocks moved CPU -> GPU", ()),
    "swapped_out_blocks": ("blocks moved GPU -> CPU", ()),
    "cow_copies": ("copy-on-write block copies", ()),
    "prompt_tokens": ("prompt tokens computed (prefill)", ()),
    "generation_tokens": ("tokens streamed to clients", ("api",)),
    "requests_finished": ("finished requests, by finish reason", ("api", "reason")),
    "requests_rejected": ("requests answered with an error status (refused or failed), by gRPC code",
                          ("api", "code")),
}
HISTOGRAMS: dict[str, tuple[str, tuple[str, ...], tuple[float, ...]]] = {
    "time_to_first_token_seconds": ("arrival to first token", ("api",), _LATENCY_BUCKETS),
    "inter_token_latency_seconds": ("time between two tokens of one sequence", ("api",), _LATENCY_BUCKETS),
    "e2e_request_latency_seconds": ("arrival to finish", ("api",), _E2E_BUCKETS),
    "request_queue_time_seconds": ("arrival to first scheduled", ("api",), _QUEUE_BUCKETS),
    "step_time_seconds": ("one engine step: schedule + executors + process result", (), _LATENCY_BUCKETS),
    "batch_size": ("sequences scheduled in one step", (), _BATCH_BUCKETS),
    "step_plan_bytes": ("encoded size of one step plan", (), _BYTES_BUCKETS),
    "step_kv_usage_ratio": ("used / total GPU KV blocks, observed at every step", (), _RATIO_BUCKETS),
    "gc_pause_seconds": ("one garbage collection of the scheduler process (the engine loop stops), by "
                         "generation", ("generation",), GC_PAUSE_BUCKETS),
}
# label values whose series exist from the start (at 0)
KNOWN_LABEL_VALUES = {
    "preemptions": [{"mode": "recompute"}, {"mode": "swap"}],
    "requests_finished": [{"reason": r} for r in ("length", "stop", "abort")],
    "requests_rejected": [{"code": c} for c in ("INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", "UNAVAILABLE",
                                                 "ABORTED", "INTERNAL")],
    "gc_pause_seconds": [{"generation": g} for g in GC_GENERATIONS],
}
PROCESS_METRICS = ("process_cpu_seconds_total", "process_resident_memory_bytes",
                   "process_virtual_memory_bytes", "process_start_time_seconds", "process_open_fds",
                   "process_max_fds")


def exported_metric_names() -> set[str]:
    """Every series name a scrape can show (counters gain _total, histograms their suffixes),
    the process metrics included."""
    names = {PREFIX + n for n in GAUGES}
    names |= {PREFIX + n + "_total" for n in COUNTERS}
    for n in HISTOGRAMS:
        names |= {PREFIX + n + s for s in ("_bucket", "_sum", "_count")}
    return names | set(PROCESS_METRICS)


class SchedulerMetrics:
    def __init__(self, model_name: str = "") -> None:
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        self.model_name = model_name
        self._fixed = {"model_name": model_name, "api": DEFAULT_API}
        self._labels: dict[str, tuple[str, ...]] = {}
        self._families: dict[str, Gauge | Counter | Histogram] = {}
        # (name, api) -> the series with no labels but model_name (and api, where the family has it)
        self._children: dict[tuple[str, str], Gauge | Counter | Histogram] = {}
        for n, (h, labels) in GAUGES.items():
            self._add(n, labels, Gauge(PREFIX + n, h, ("model_name", *labels), registry=self.registry))
        for n, (h, labels) in COUNTERS.items():
            self._add(n, labels, Counter(PREFIX + n, h, ("model_name", *labels), registry=self.registry))
        for n, (h, labels, b) in HISTOGRAMS.items():
            self._add(n, labels, Histogram(PREFIX + n, h, ("model_name", *labels), registry=self.registry,
                                           buckets=b))
        for n, known in KNOWN_LABEL_VALUES.items():
            for values in known:
                self._child(n, values)
        self._totals: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        self._http: MetricsHttpServer | None = None
        self._gc_pauses = [self._child("gc_pause_seconds", {"generation": g}) for g in GC_GENERATIONS]
        self._stop_gc_watch: Callable[[], None] | None = None

    def _add(self, name: str, labels: tuple[str, ...], family: Gauge | Counter | Histogram) -> None:
        self._families[name] = family
        self._labels[name] = ("model_name", *labels)
        if set(labels) <= {"api"}:
            self._children[name, DEFAULT_API] = self._child(name, {})

    def _child(self, name: str, labels: dict[str, str]) -> Gauge | Counter | Histogram:
        """The series of `name` with `labels` (model_name and, unless given, api filled in)."""
        values = {k: labels[k] if k in labels else self._fixed[k] for k in self._labels[name]}
        return self._families[name].labels(**values)

    def _series(self, name: str, api: str) -> Gauge | Counter | Histogram:
        """The series of `name` labelled only with model_name and `api` (cached: the hot path)."""
        child = self._children.get((name, api))
        if child is None:
            child = self._children[name, api] = self._child(name, {"api": api})
        return child

    def set(self, name: str, value: float) -> None:
        self._children[name, DEFAULT_API].set(value)  # type: ignore[union-attr]  # a gauge's name

    def inc(self, name: str, amount: float = 1.0, api: str = DEFAULT_API, **labels: str) -> None:
        if amount <= 0:
            return
        counter = self._child(name, {"api": api, **labels}) if labels else self._series(name, api)
        counter.inc(amount)  # type: ignore[union-attr]  # a counter's name

    def set_total(self, name: str, total: float, **labels: str) -> None:
        """Feed a cumulative total; the counter grows by the increase since the last call."""
        key = (name, tuple(sorted(labels.items())))
        previous = self._totals.get(key, 0.0)
        if total > previous:
            self.inc(name, total - previous, **labels)
            self._totals[key] = total

    def observe(self, name: str, value: float, api: str = DEFAULT_API) -> None:
        self._series(name, api).observe(value)  # type: ignore[union-attr]  # a histogram's name

    def observe_many(self, name: str, value: float, count: int, api: str = DEFAULT_API) -> None:
        """`count` observations of `value`, as `count` calls of observe would leave the histogram
        (its bucket and count up by `count`, its sum by value × count), in one update where
        prometheus_client's Histogram has the fields it has had since 0.4 (else observe, `count` times)."""
        series: Any = self._series(name, api)
        bounds, buckets, total = (getattr(series, f, None) for f in ("_upper_bounds", "_buckets", "_sum"))
        if count == 1 or bounds is None or buckets is None or total is None or value != value:
            for _ in range(count):
                series.observe(value)
            return
        total.inc(value * count)
        buckets[bisect.bisect_left(bounds, value)].inc(count)  # the first bound >= value (the last is +Inf)

    def count_rejected(self, code: str, api: str = DEFAULT_API) -> None:
        """A request answered with the gRPC status `code` (its name, e.g. "INVALID_ARGUMENT"). An `api`
        outside APIS (a refused request's own claim) counts as DEFAULT_API: no new label values."""
        self.inc("requests_rejected", code=code, api=api if api in APIS else DEFAULT_API)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def serve(self, port: int, addr: str = "0.0.0.0") -> int:
        """Serve /metrics and /health over HTTP on `port` (0 picks a free port); returns the bound
        port. /health answers 503 until `watch_health` gives it the gRPC health. From now until
        `close`, every garbage collection of this process is timed (gc_pause_seconds)."""
        self._http = MetricsHttpServer(self.registry, port, addr)
        if self._stop_gc_watch is None:
            self._stop_gc_watch = watch_gc_pauses(self.observe_gc_pause)
        return self._http.port

    def observe_gc_pause(self, generation: int, seconds: float) -> None:
        self._gc_pauses[generation].observe(seconds)  # type: ignore[union-attr]  # a histogram

    def watch_health(self, health: HealthState) -> None:
        """/health, /readyz and /healthz answer from `health` (the gRPC server's) from now on."""
        if self._http is not None:
            self._http.health = health

    @property
    def port(self) -> int | None:
        """The /metrics HTTP port, once `serve` ran."""
        return self._http.port if self._http is not None else None

    def close(self) -> None:
        if self._stop_gc_watch is not None:
            self._stop_gc_watch()
            self._stop_gc_watch = None
        if self._http is not None:
            self._http.close()
            self._http = None
