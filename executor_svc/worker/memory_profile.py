"""How many KV blocks fit on one rank, and what its memory holds now.

Explicit block counts (CacheConfig) win. Otherwise on CUDA the device cache gets what a profile
leaves: total memory * gpu_memory_utilization - (the peak of the largest step + memory held outside
torch); on CPU it gets `cpu_kv_gib`. The largest step is a forward pass over max_num_batched_tokens
followed by the sampler over max_num_seqs rows, with every sampling option on (the top-k / top-p
sort, seeds, the most logprobs and beam candidates): the sampler's [rows, vocab] temporaries are
GiBs at a large vocabulary. The swap space gets `swap_space_gib`, never more blocks than the device
cache.
"""

from __future__ import annotations

import torch

from executor_svc.runner.cache_config import CacheConfig
from executor_svc.runner.errors import CacheAllocationError
from executor_svc.runner.kv_cache import GIB, KVCache, blocks_from_profile
from executor_svc.runner.model_runner import ModelRunner
from executor_svc.worker.protocol import MemoryUsage


def blocks_that_fit(
    cc: CacheConfig, device: torch.device, block_bytes: int, profile_gpu_blocks
) -> tuple[int, int]:
    """(num_gpu_blocks, num_cpu_blocks); `profile_gpu_blocks()` runs the profile (CUDA only)."""
    num_gpu = cc.num_gpu_blocks
    if num_gpu is None and device.type == "cuda":
        num_gpu = profile_gpu_blocks()
    elif num_gpu is None:
        num_gpu = int(cc.cpu_kv_gib * GIB) // block_bytes
    num_cpu = cc.num_cpu_blocks
    if num_cpu is None:
        num_cpu = int(cc.swap_space_gib * GIB) // block_bytes
    if num_gpu < 1:
        raise MemoryError("no KV cache block fits in the memory budget")
    return num_gpu, min(num_cpu, num_gpu)


def profile_gpu_blocks(
    model,
    cc: CacheConfig,
    num_layers: int,
    num_kv_heads_per_rank: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    block_bytes: int,
) -> int:
    """Runs the largest step (ModelRunner.profile_run: forward and sampler) with a one-block cache
    and measures its peak."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    probe = KVCache(
        num_layers,
        num_kv_heads_per_rank,
        head_dim,
        cc.block_size,
        1,
        0,
        dtype,
        device,
    )
    ModelRunner(model, probe).profile_run(cc.max_num_batched_tokens, cc.max_num_seqs)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    free, total = torch.cuda.mem_get_info(device)
    non_torch = (total - free) - torch.cuda.memory_reserved(device)
    del probe
    torch.cuda.empty_cache()
    return blocks_from_profile(
        total, cc.gpu_memory_utilization, peak + max(0, non_torch), block_bytes
    )


def free_device_bytes(device: torch.device) -> int | None:
    """Bytes a new allocation can take on the device: the driver's free memory plus what torch's
    allocator holds unused; None on the CPU (its cache size is set by cpu_kv_gib)."""
    if device.type != "cuda":
        return None
    free, _total = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def check_cache_fits(device: torch.device, block_bytes: int, num_gpu_blocks: int) -> None:
    """Raises CacheAllocationError, naming the numbers, when the device cache cannot be allocated."""
    free = free_device_bytes(device)
    need = block_bytes * num_gpu_blocks
    if free is not None and need > free:
        raise CacheAllocationError(
            f"cannot allocate the KV cache on {device}: {num_gpu_blocks} blocks x {block_bytes} bytes = "
            f"{need / GIB:.2f} GiB, {free / GIB:.2f} GiB free"
        )


def memory_usage(
    device: torch.device, block_bytes: int, num_gpu_blocks: int, num_cpu_blocks: int, cache_allocated: bool
) -> MemoryUsage:
    """torch's allocator on the device (0 on CPU) and the KV cache's bytes once allocated."""
    on_gpu = device.type == "cuda"
    return MemoryUsage(
        gpu_allocated_bytes=torch.cuda.memory_allocated(device) if on_gpu else 0,
        gpu_reserved_bytes=torch.cuda.memory_reserved(device) if on_gpu else 0,
        kv_cache_gpu_bytes=block_bytes * max(num_gpu_blocks, 0) if cache_allocated else 0,
        kv_cache_cpu_bytes=block_bytes * max(num_cpu_blocks, 0) if cache_allocated else 0,
    )
