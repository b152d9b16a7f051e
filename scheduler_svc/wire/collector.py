"""The Python garbage collector in a server process: its start-up heap frozen out of collections
(`freeze_startup_heap`), and each collection's pause timed for the process's /metrics
(`watch_gc_pauses`). A collection holds the GIL: in the executor it stops the step launch, in the
scheduler the plan, in the API front-end every stream's delivery (docs/benchmarks.md, round 14)."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable

GC_GEN0_THRESHOLD = 20_000
GC_PAUSE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
GC_GENERATIONS = ("0", "1", "2")


def freeze_startup_heap(gen0_threshold: int = GC_GEN0_THRESHOLD) -> None:
    """Once a server is built: everything alive now (modules, gRPC, the model and its graphs, the
    tokenizer, metrics) lives as long as the process, so it leaves the collector's generations
    (`gc.freeze`) and the collections triggered by the per-step churn (plans, deltas, protobuf
    messages, futures) no longer scan it; young collections are made rarer too (the scheduler's
    gain was measured with clients.bench.engine). Unfrozen, a full collection of an executor's heap
    (~175 thousand objects once torch is imported) took 93 ms on the development CPU, and the H100
    runs showed 100–130 ms stalls of every stream mid-run. Each server calls it when its start-up
    is over (the executor: after every InitCache, which builds the cache and captures the
    graphs). Called again (the executor's next InitCache), it first unfreezes, so objects frozen
    then and dead since (a replaced cache's runner in a reference cycle) are collected."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(gen0_threshold, gen1, gen2)


def watch_gc_pauses(observe: Callable[[int, float], None]) -> Callable[[], None]:
    """Calls `observe(generation, seconds)` after every collection of this process (gc.callbacks;
    the collector runs with the GIL held, one collection at a time). Returns the function that stops
    it."""
    started = [0.0]

    def on_collection(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            observe(info["generation"], time.perf_counter() - started[0])

    gc.callbacks.append(on_collection)

    def stop() -> None:
        if on_collection in gc.callbacks:
            gc.callbacks.remove(on_collection)

    return stop
