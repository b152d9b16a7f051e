"""The ceilings the ideal time (clients/bench/report.py `ideal_time`) divides by, measured on this
machine's GPUs: one GPU's copy and bf16 matmul rates, and the all-reduce latency and bus bandwidth
over `world_size` GPUs (NCCL, one process per GPU, as the executor ranks run)."""

from __future__ import annotations

from collections.abc import Callable

from clients.bench.report import AllReduceRates, DeviceRates

ALL_REDUCE_SMALL_BYTES = 16 << 10  # latency: a message the size of a few decode tokens' hidden states
ALL_REDUCE_LARGE_BYTES = 256 << 20  # bandwidth


def measure_device_rates() -> DeviceRates:
    """The two ceilings on this GPU: a 1 GiB copy and an 8192^3 bf16 matrix product (median of 10;
    kernels/bench_common.py `device_rates`, which the kernel benchmarks' bounds use too)."""
    import torch

    from kernels.bench_common import device_rates

    return DeviceRates(torch.cuda.get_device_name(), *device_rates())


def measure_all_reduce_rates(world_size: int) -> AllReduceRates:
    """All-reduce of bf16 messages over GPUs 0 .. world_size-1, one spawned process each (NCCL, the
    environment inherited: keep NVLink multicast off where docs/tensor_parallel.md says so). The
    latency is the median time of a 16 KiB all-reduce replayed from a CUDA graph of 20 back to back,
    as the executor's decode graphs run them (issued eagerly, each one also pays ~30 us of host
    launch: 43.9 us per all-reduce measured that way on 2x H100, which made the ideal too lenient);
    the bus bandwidth comes from a 256 MiB one with that latency taken
    off, so `AllReduceRates.time_s` reproduces both measured times."""
    import torch
    import torch.multiprocessing as mp

    from clients.cli.serve import free_port

    if world_size < 2:
        raise ValueError(f"an all-reduce needs at least 2 GPUs, not {world_size}")
    if not torch.cuda.is_available() or torch.cuda.device_count() < world_size:
        found = torch.cuda.device_count() if torch.cuda.is_available() else 0
        raise RuntimeError(f"measuring an all-reduce over {world_size} GPUs needs {world_size} CUDA GPUs; "
                           f"this machine has {found}")
    results = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_all_reduce_rank, args=(world_size, free_port(), results), nprocs=world_size, join=True)
    small_s, large_s = results.get()
    factor = 2 * (world_size - 1) / world_size
    return AllReduceRates(small_s, factor * ALL_REDUCE_LARGE_BYTES / (large_s - small_s), world_size)


def _all_reduce_rank(rank: int, world_size: int, port: int, results) -> None:
    """One rank of `measure_all_reduce_rates`; rank 0 puts (small, large) seconds per all-reduce."""
    import torch
    import torch.distributed as dist

    from kernels.bench_common import events_median_ms

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, device_id=device)
    try:
        small = torch.zeros(ALL_REDUCE_SMALL_BYTES // 2, dtype=torch.bfloat16, device=device)
        large = torch.zeros(ALL_REDUCE_LARGE_BYTES // 2, dtype=torch.bfloat16, device=device)
        small_ms = _graph_ms(lambda: dist.all_reduce(small), 20)
        large_ms = events_median_ms(lambda: dist.all_reduce(large), reps=2)
        if rank == 0:
            results.put((small_ms / 1e3, large_ms / 1e3))
    finally:
        dist.destroy_process_group()


def _graph_ms(fn: Callable[[], object], count: int) -> float:
    """Per call: `count` calls of fn captured in one CUDA graph (after eager warm-ups on a side
    stream, which also sets up NCCL), the graph's replay timed by `events_median_ms`."""
    import torch

    from kernels.bench_common import events_median_ms

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(count):
            fn()
    return events_median_ms(graph.replay) / count
