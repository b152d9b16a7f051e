"""What the kernel benchmarks (kernels/bench.py, kernels/bench_prefill.py) share: the model shape
they time, the cache layout, the timers, the device's copy and matmul rates, and the paged-to-contiguous
K/V copy SDPA reads. The engine's GEMM plan (executor_svc/layers/gemm_plan.py) times its candidates
with `graph_call_us` (a wide search screens with `queued_call_us` first), and `bench throughput`'s
ideal (clients/bench/device_rates.py) divides by `device_rates`."""

import math
import statistics
import time

import torch
import triton.testing

LLAMA3_8B = dict(num_heads=32, num_kv_heads=8, head_dim=128, num_layers=32)
BLOCK_SIZE = 16
DTYPE = torch.bfloat16
DEV = "cuda"


def time_ms(fn, rep: int = 100) -> float:
    """Median ms of fn (triton.testing.do_bench: CUDA events, warm-up first, L2 flushed between runs)."""
    return triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median")


def events_median_ms(fn, reps: int = 1) -> float:
    """Median over 10 timings (CUDA events, after 3 warm-ups) of `reps` back-to-back calls, per call."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(10):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end) / reps)
    return statistics.median(times)


def device_rates() -> tuple[float, float]:
    """This GPU's two ceilings: (a 1 GiB device-to-device copy's bytes read + written per second, an
    8192^3 bf16 product's FLOP/s), medians of `events_median_ms`. `bench throughput`'s ideal
    (clients/bench/device_rates.py) and the kernel benchmarks' bounds both divide by these."""
    src = torch.randn(1 << 29, dtype=torch.bfloat16, device=DEV)  # 1 GiB
    dst = torch.empty_like(src)
    copy_ms = events_median_ms(lambda: dst.copy_(src))
    n = 8192
    a = torch.randn(n, n, dtype=torch.bfloat16, device=DEV)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=DEV)
    mm_ms = events_median_ms(lambda: a @ b)
    return 2 * (1 << 29) * 2 / (copy_ms / 1e3), 2 * n**3 / (mm_ms / 1e3)


def time_graph_ms(fn, rep: int = 100) -> float:
    """time_ms of fn captured in a CUDA graph and replayed, as the engine runs its steps: the GPU's
    time without the host's launch cost (a Triton launch with TMA descriptors costs the host more than
    the kernel of a short step runs). Where capture fails (or without CUDA), time_ms of fn itself."""
    if not torch.cuda.is_available():
        return time_ms(fn, rep)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # compile, settle the allocator
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
    except RuntimeError:
        torch.cuda.synchronize()
        return time_ms(fn, rep)
    return time_ms(graph.replay, rep)


def graph_call_us(calls, replays: int = 20) -> float:
    """Median GPU time per call (µs) of one CUDA graph holding every call, over `replays` replays
    (after one to warm up); the first call runs once eagerly on a side stream before the capture
    (compile, settle the allocator). One call per layer's own weight keeps the weights out of L2."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        calls[0]()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(calls))
    del graph
    return statistics.median(times)


MIN_SLEEP_US, MAX_SLEEP_US = 200.0, 1e6  # queued_call_us's sleep kernel, before a chunk of candidates


def queued_call_us(call_sets, chunk: int = 32, sleep_us: float = 2000.0) -> list[float]:
    """GPU time per call (µs) of each set of calls run back to back, without a CUDA graph per set: a
    screen of many candidates (the GEMM plan's wide search) at a fraction of `graph_call_us`'s cost,
    whose capture and instantiation dominate for short kernels. Every set runs once first (compile,
    descriptors, the allocator); a set that raises then, or later, gets inf. The sets are then queued
    `chunk` at a time, each between two timing events, behind a sleep kernel long enough for the host
    to enqueue the whole chunk before the GPU reaches it, so no set's time holds the host's launch
    cost; a chunk whose enqueue outlasted its sleep is queued again behind a longer one."""
    results = [math.inf] * len(call_sets)
    ready = []
    for i, calls in enumerate(call_sets):
        try:
            calls[0]()
            ready.append(i)
        except Exception:  # noqa: BLE001 - a candidate that cannot run is not timed
            continue
    torch.cuda.synchronize()
    cycles_per_us = None
    pos = 0
    while pos < len(ready):
        part = ready[pos: pos + chunk]
        begin_sleep, end_sleep = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        marks = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in part]
        cycles = int(sleep_us * (cycles_per_us or 2000.0))  # ~2 GHz until measured
        begin_sleep.record()
        torch.cuda._sleep(cycles)
        end_sleep.record()
        started = time.perf_counter()
        failed = set()
        for (begin, end), i in zip(marks, part, strict=True):
            begin.record()
            try:
                for call in call_sets[i]:
                    call()
            except Exception:  # noqa: BLE001
                failed.add(i)
            end.record()
        host_us = (time.perf_counter() - started) * 1e6
        marks[-1][1].synchronize()
        slept_us = begin_sleep.elapsed_time(end_sleep) * 1e3
        cycles_per_us = cycles / max(slept_us, 1.0)
        if host_us > 0.8 * slept_us and sleep_us < MAX_SLEEP_US:  # the GPU may have waited for the host
            sleep_us = min(MAX_SLEEP_US, 2.0 * host_us)
            continue
        for (begin, end), i in zip(marks, part, strict=True):
            if i not in failed:
                results[i] = begin.elapsed_time(end) * 1e3 / len(call_sets[i])
        sleep_us = max(MIN_SLEEP_US, 1.5 * host_us)  # the next chunk's enqueue takes about as long
        pos += chunk
    return results


def contiguous_kv(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """[B, kv_heads, context, dim] copy of the paged cache, for SDPA."""
    batch = block_tables.shape[0]
    gathered = cache[block_tables.long()]  # [B, blocks, bs, kvh, d]
    return gathered.flatten(1, 2).transpose(1, 2).contiguous().view(batch, cache.shape[2], -1, cache.shape[3])


def paged_kv(batch: int, blocks_per_seq: int, kv_heads: int, head_dim: int, gen: torch.Generator,
             device: str, dtype: torch.dtype) -> tuple:
    """(key_cache, value_cache, block_tables): random caches of BLOCK_SIZE-slot blocks with 64 spare
    blocks, and each of `batch` sequences' blocks_per_seq blocks scattered over them ([B, n] int32)."""
    num_blocks = batch * blocks_per_seq + 64
    shape = (num_blocks, BLOCK_SIZE, kv_heads, head_dim)
    key_cache = torch.randn(shape, device=device, dtype=dtype, generator=gen)
    value_cache = torch.randn(shape, device=device, dtype=dtype, generator=gen)
    perm = torch.randperm(num_blocks, device=device, generator=gen)[: batch * blocks_per_seq]
    return key_cache, value_cache, perm.view(batch, blocks_per_seq).to(torch.int32)
