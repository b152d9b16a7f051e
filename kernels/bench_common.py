"""What the kernel benchmarks (kernels/bench.py, kernels/bench_prefill.py) share: the model shape
they time, the cache layout, the timers, the device's copy and matmul rates, and the paged-to-contiguous
K/V copy SDPA reads. The engine's GEMM plan (executor_svc/layers/gemm_plan.py) times its candidates
with `graph_call_us`, and `bench throughput`'s ideal (clients/bench/device_rates.py) divides by
`device_rates`."""

import statistics

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
